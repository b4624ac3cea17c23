"""`dspine bench`: AR and a drafter in one run, the round split into phases (engine); the SGLang backend's
option checks (its servers run on the GPU: test_sglang_gpu.py) and its table."""

import json

from dspine.checkpoint import save_drafter
from dspine.cli import main
from dspine.drafter import DSpineDraftModel


def test_engine_bench_reports_speed_and_round_phases(tmp_path, smollm2, capsys):
    ckpt = save_drafter(DSpineDraftModel.for_target(smollm2, method="dspine", num_hidden_layers=1), tmp_path / "d")
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--drafter",
                f"dspine={ckpt}",
                "--benchmarks",
                "gsm8k",
                "--limit",
                "1",
                "--max-new-tokens",
                "10",
                "--out",
                str(out),
                "--no-progress",
                "--concurrency",
                "1,2",
                "--dtype",
                "float32,bfloat16",
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    # the bf16 target beside the fp32 reference: its own AR, speed against both ARs, its AR match rates (fp32
    # speculative equals fp32 AR; bf16 rows carry rates: a k-token bf16 forward rounds unlike k 1-token ones)
    bf = doc["rows"]["dspine@bf16"]
    assert doc["other_dtypes"] == {"bf16": "bfloat16"} and doc["rows"]["ar@bf16"]["speedup_vs_own_ar"] == 1.0
    assert doc["rows"]["ar@bf16"]["match_own_ar"] == 1.0 and doc["rows"]["ar"]["match_ar"] == 1.0
    assert doc["rows"]["dspine"]["match_ar"] == doc["by_concurrency"]["2"]["dspine"]["match_ar"] == 1.0
    assert bf["match_ar"] in (0.0, 1.0) and bf["match_own_ar"] in (0.0, 1.0)  # one request: all or nothing
    assert bf["speedup_vs_ar"] == bf["tokens_per_s"] / doc["rows"]["ar"]["tokens_per_s"]
    assert abs(bf["round_over_ar_step"] - bf["round_ms"] / doc["rows"]["ar@bf16"]["ar_step_ms"]) < 1e-9
    ar, ds = doc["rows"]["ar"], doc["rows"]["dspine"]
    assert doc["concurrency"] == 1 and ar["speedup_vs_ar"] == 1.0 and ar["tokens"] == ds["tokens"] == 10
    assert ds["rounds"] >= 1 and set(ds["phase_ms_per_round"]) == {"draft", "propose", "verify", "commit"}
    assert all(v > 0 for v in ds["phase_ms_per_round"].values())
    assert ds["round_ms"] * ds["rounds"] / 1000 <= ds["seconds"]  # the phases fit inside the measured time
    assert abs(ds["round_over_ar_step"] - ds["round_ms"] / ar["ar_step_ms"]) < 1e-9
    # concurrency 2: the batched engine decodes the same tokens (lossless), τ from the same stats type
    c2 = doc["by_concurrency"]["2"]
    assert c2["ar"]["tokens"] == c2["dspine"]["tokens"] == 10 and c2["dspine"]["tau_mean"] >= 1.0
    # the decode alone: the tokens after the prefill's first over the seconds outside prefills
    for r in (c2["ar"], c2["dspine"]):
        assert 0 < r["prefill_s"] < r["seconds"] and r["batched_rounds"] >= 1
        assert abs(r["decode_tokens_per_s"] - 9 / (r["seconds"] - r["prefill_s"])) < 1e-6
    assert c2["ar"]["decode_vs_ar"] == 1.0 and c2["ar"]["batched_rounds"] == 9  # AR: a round per token
    assert "decode tok/s (× AR)" in out.with_suffix(".md").read_text()
    assert "| dspine |" in capsys.readouterr().out and out.with_suffix(".md").is_file()
    for bad in ("float32,float32", "float32,int8", ""):
        assert main(["bench", "--dtype", bad]) == 2 and "--dtype" in capsys.readouterr().err
    assert main(["bench", "--backend", "sglang", "--dtype", "float32,bfloat16"]) == 2
    assert "one dtype with --backend sglang" in capsys.readouterr().err
    # SGLang needs CUDA: here it is absent, which the sglang backend says after checking its own options
    assert main(["bench", "--backend", "sglang", "--concurrency", "1,x"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["bench", "--backend", "sglang", "--concurrency", "4,16"]) == 2
    assert "must include 1" in capsys.readouterr().err
    assert main(["bench", "--backend", "sglang", "--summary", str(tmp_path / "s.json")]) == 2
    assert "named dspine and dflash" in capsys.readouterr().err
    assert main(["bench", "--backend", "sglang", "--drafter", f"dflash={ckpt}", "--engine-agreement", "2"]) == 2
    assert "--agreement-drafters ['dspine']" in capsys.readouterr().err
    assert main(["bench", "--backend", "sglang", "--server-env", "dspine:DSPINE_CANDIDATES"]) == 2
    assert "is not NAME:KEY=VALUE" in capsys.readouterr().err
    assert (
        main(
            [
                "bench",
                "--backend",
                "sglang",
                "--drafter",
                f"dflash={ckpt}",
                "--server-env",
                "dspine:DSPINE_CANDIDATES=torch",
            ]
        )
        == 2
    )
    assert "'dspine' is not a measured method (ar, dflash)" in capsys.readouterr().err
    assert main(["bench", "--backend", "sglang", "--server-env", "ar:DSPINE_KERNELS=0"]) == 2
    assert "needs SGLang" in capsys.readouterr().err  # a well-formed --server-env passes the checks


def test_replay_agreement_on_another_engines_outputs(tiny):
    """The SGLang bench's τ agreement: dspine's engine replays the outputs a server returned (here: the engine's
    own free run standing in for SGLang's) and τ per benchmark is set beside the server's."""
    from conftest import brief_train

    from dspine.engine import Engine
    from dspine.eval.replay import replay
    from dspine.sampling import SamplingParams
    from dspine.sglang.bench import replay_agreement, replay_jobs

    target, pairs = tiny
    drafter = brief_train(
        DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2, block_size=8, top_k=4, seed=4),
        target,
        pairs[4:],
        steps=40,
    )
    eng = Engine(target, drafter)
    prompts = [ids[:start] for ids, start in pairs[:4]]
    free = [eng.generate(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
    bench_of = ["gsm8k", "gsm8k", "mbpp", "mbpp"]
    doc = {
        "prompt_ids": prompts,
        "outputs_c1": {"dspine": [r.token_ids for r in free]},
        "benchmark_of": bench_of,
        "tau_per_benchmark_c1": {
            "dspine": {b: sum(r.stats.tau for r, bb in zip(free, bench_of) if bb == b) / 2 for b in ("gsm8k", "mbpp")}
        },
    }
    jobs = replay_jobs(doc, ["dspine"])
    res = replay(target, {"dspine": drafter}, jobs, progress=False)
    agree = replay_agreement(doc, jobs, res, "float32")["dspine"]
    assert set(agree["per_benchmark"]) == {"gsm8k", "mbpp"} and agree["requests"] == 4
    # the same text and the same drafter: only the last round of a request may differ (drafts past the end)
    for r, f in zip(res, free):
        assert r["rounds"] == f.stats.rounds and r["accepted"] <= f.stats.accepted
    assert agree["max_rel_diff"] < 0.25 and all(v["ratio"] >= 1.0 for v in agree["per_benchmark"].values())
