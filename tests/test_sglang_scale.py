"""The pure parts of the SGLang-at-scale bench (bench/experiments/shape_scale.py) on the CPU: the shape folders SGLang
serves with random weights, the projection arithmetic and the summary section. The measurement itself runs on
the H200 (bench/experiments/sglang_scale.py)."""

import gzip
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from dspine.checkpoint import config_from_json
from dspine.config import ConfigError
from dspine.sglang.export import sglang_weight_shapes
from dspine.target import DEFAULT_TARGET, resolve_target_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "experiments"))  # the lab, not the package
from shape_scale import (
    PAPER_TAU,
    SHAPES,
    ScaleConfig,
    analyse,
    fit_round,
    kernel_diff,
    kernel_times,
    project,
    scale_markdown,
    scale_section,
    shape_config,
    write_shape,
)


def test_shape_folders_hold_the_8b_shape_with_the_builtin_tokenizer(tmp_path):
    paths = write_shape(tmp_path, "qwen3-8b", resolve_target_path(DEFAULT_TARGET))
    cfg = AutoConfig.from_pretrained(paths["target"])
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == ("qwen3", 4096, 36, 12288)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (32, 8, 128, 49152)
    tok = AutoTokenizer.from_pretrained(paths["target"])
    assert len(tok) <= cfg.vocab_size and cfg.eos_token_id == tok.convert_tokens_to_ids(tok.eos_token)
    for method, arch in (("dflash", "DFlashDraftModel"), ("dspine", "DSpineDraftModel")):
        raw = json.loads((tmp_path / "qwen3-8b" / method / "config.json").read_text())
        assert raw["architectures"] == [arch] and raw["torch_dtype"] == "bfloat16"
        d = config_from_json({**raw, "architectures": ["DSpineDraftModel"]})  # SGLang's name, dspine's fields
        assert (d.method, d.hidden_size, d.num_hidden_layers, d.num_target_layers, d.block_size) == (
            method,
            4096,
            5,
            36,
            16,
        )
        assert all(0 <= i < 36 for i in d.target_layer_ids) and len(d.target_layer_ids) == 5
        shapes = sglang_weight_shapes(d)
        n = sum(math.prod(s) for s in shapes.values())
        # 5 layers of the 8B shape + fc: about 1 B parameters (2 GB in bf16), DSpine adds the injections
        assert 0.9e9 < n < 1.2e9
        assert any(k.startswith("injections.4.") for k in shapes) == (method == "dspine")
    four = write_shape(tmp_path, "qwen3-4b", resolve_target_path(DEFAULT_TARGET))
    assert AutoConfig.from_pretrained(four["target"]).hidden_size == 2560


def test_shape_folders_at_qwen3s_vocabulary_with_its_real_tokenizer(tmp_path):
    """With Qwen3's tokenizer (no model config beside it) the 8B and 4B shapes get Qwen3's 151,936-row output
    head, the drafters' candidate heads too; a shape file whose head is narrower than the tokenizer is refused."""
    import gzip
    import shutil

    tok = tmp_path / "qwen3_tok"
    tok.mkdir()
    src = Path(__file__).resolve().parent / "data" / "qwen3_tokenizer"
    with gzip.open(src / "tokenizer.json.gz", "rb") as f, open(tok / "tokenizer.json", "wb") as g:
        shutil.copyfileobj(f, g)
    shutil.copy(src / "tokenizer_config.json", tok / "tokenizer_config.json")
    for shape in ("qwen3-8b", "qwen3-4b"):
        paths = write_shape(tmp_path / "out", shape, tok)
        cfg = AutoConfig.from_pretrained(paths["target"])
        assert cfg.vocab_size == 151936 and len(AutoTokenizer.from_pretrained(paths["target"])) <= 151936
        for method in ("dflash", "dspine"):
            raw = json.loads((Path(paths[method]) / "config.json").read_text())
            assert config_from_json({**raw, "architectures": ["DSpineDraftModel"]}).vocab_size == 151936
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps({**SHAPES["qwen3-4b"], "vocab_size": 49152}))
    with pytest.raises(ConfigError, match="151669 tokens do not fit the shape's 49152-row"):
        write_shape(tmp_path / "out", str(narrow), tok)


def test_shape_from_a_config_file_and_bad_shapes(tmp_path):
    good = tmp_path / "mine.json"
    good.write_text(
        json.dumps(
            {
                "hidden_size": 1024,
                "intermediate_size": 3072,
                "num_hidden_layers": 28,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "tie_word_embeddings": True,
            }
        )
    )
    name, cfg = shape_config(str(good))
    assert name == "mine" and cfg["hidden_size"] == 1024 and cfg["vocab_size"] == 49152
    with pytest.raises(ConfigError, match="neither one of"):
        shape_config("qwen3-800b")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 1024}))
    with pytest.raises(ConfigError, match="missing \\['intermediate_size'"):
        shape_config(str(bad))
    bad.write_text(json.dumps({**json.loads(good.read_text()), "vocab_size": 151936}))
    with pytest.raises(ConfigError, match="vocab_size 151936 — the prompts' tokenizer needs 49152"):
        write_shape(tmp_path, str(bad), resolve_target_path(DEFAULT_TARGET))  # the built-in tokenizer's 49152
    with pytest.raises(ConfigError, match="must include 1"):
        ScaleConfig(concurrencies=[4, 16]).validate()
    with pytest.raises(ConfigError, match="outside"):
        ScaleConfig(taus=[0.5]).validate()
    with pytest.raises(ConfigError, match="profile_requests"):
        ScaleConfig(profile_requests=-1).validate()
    with pytest.raises(ConfigError, match="attention_backend 'fa2'"):
        ScaleConfig(attention_backend="fa2").validate()
    with pytest.raises(ConfigError, match="section 'acceptance'"):
        ScaleConfig(section="acceptance").validate()  # a run must not overwrite another part of the summary
    with pytest.raises(ConfigError, match="tp 2 with group 4"):
        ScaleConfig(tp=2).validate()  # a tensor-parallel server holds every GPU: one at a time
    ScaleConfig(shape="qwen3-32b", tp=4, group=1).validate()


def test_projection_arithmetic():
    # rounds grow linearly with τ: 10 + 0.5 τ ms (dspine), 9.5 + 0.5 τ (dflash)
    assert fit_round({2.0: 11.0, 4.0: 12.0}) == pytest.approx((10.0, 0.5))
    assert fit_round({3.0: 7.0}) == (7.0, 0.0)
    rounds = {"dspine": {2.0: 11.0, 3.0: 11.5, 4.8: 12.4}, "dflash": {2.0: 10.5, 3.0: 11.0, 4.8: 11.9}}
    p = project(rounds, 8.0, {"paper": PAPER_TAU, "same": {"dspine": 3.0, "dflash": 3.0}})
    r = 10 + 0.5 * 4.82
    assert p["paper"]["dspine"]["vs_ar"] == pytest.approx(4.82 * 8 / r)
    assert p["paper"]["dflash"]["vs_ar"] == pytest.approx(3.77 * 8 / (9.5 + 0.5 * 3.77))
    assert p["same"]["dspine_vs_dflash"] == pytest.approx(11.0 / 11.5)


def _row(tps, tau=None, round_ms=None, gpu=None, step=None):
    row = {"tokens_per_s": tps, "requests": 8, "tokens": 2048, "seconds": 2048 / tps}
    if tau is not None:
        row.update(
            tau_pooled=tau, gpu_round_ms=gpu, phase_ms_per_round={"draft": 1.0, "verify": gpu - 1.5, "glue": 0.5}
        )
    if round_ms is not None:
        row["round_ms"] = round_ms
    if step is not None:
        row["ar_step_ms"] = step
    return row


def test_analysis_and_summary_section():
    var = {"ar": {"method": "ar", "forced_tau": None, "by_concurrency": {"1": _row(125, step=8.0), "4": _row(480)}}}
    for m, extra in (("dflash", 0.0), ("dspine", 0.2)):
        for t in (2.0, 3.0, 4.8):
            rnd = 10 + 0.5 * t + extra
            var[f"{m}@{t:g}"] = {
                "method": m,
                "forced_tau": t,
                "by_concurrency": {
                    "1": _row(1000 * t / rnd, t, rnd, rnd - 0.3),
                    "4": _row(4000 * t / (rnd + 2), t, None, rnd + 2),
                },
            }
    var["dspine@9"] = {"method": "dspine", "forced_tau": 9.0, "error": "RuntimeError: SGLang did not start"}
    doc = {
        "settings": {"concurrencies": [1, 4], "flags": ["--load-format", "dummy", "--attention-backend", "fa3"]},
        "variants": var,
    }
    kernels = {"injection_ms": 0.1, "injection_variant": "split", "transition_ms": 0.2}
    doc.update(analyse(doc, {"dspine": 2.0, "dflash": 1.77}, kernels))
    r3 = doc["dspine_over_dflash"]["3"]
    assert r3["1"]["gpu_round"] == pytest.approx((11.7 - 0.3) / (11.5 - 0.3))
    assert r3["4"]["throughput"] == pytest.approx((11.5 + 2) / (11.7 + 2))
    assert doc["table"]["dspine@3"]["1"]["round_over_ar_step"] == pytest.approx(11.7 / 8)
    assert doc["projection"]["measured"]["dspine"]["tau"] == 2.0
    sec = scale_section({"shapes": {"qwen3-8b": doc}})
    assert sec["shape"] == "qwen3-8b" and sec["injection_ms"] == 0.1 and sec["transition_ms"] == 0.2
    assert sec["attention_backend"] == "fa3"
    assert sec["round_over_ar_step_c1"]["dspine"] == pytest.approx(11.7 / 8)
    assert sec["dspine_vs_ar_c1_tau4_8"] == pytest.approx(1000 * 4.8 / (12.6 * 125))
    assert sec["dspine_round_over_dflash"]["4.8"]["4"] == pytest.approx(14.6 / 14.4)
    assert sec["errors"] == {"dspine@9": "RuntimeError: SGLang did not start"}
    assert doc["kernel_diff"] == {}  # no profiles measured
    md = scale_markdown({"shapes": {"qwen3-8b": doc}})
    assert "dspine@4.8" in md and "dspine@9 failed" in md and "Projection" in md and "kernels per round" not in md
    # profiles of both drafters at τ = 3: DSpine ran one kernel more and its matmuls longer
    var["dspine@3"]["profile"] = {
        "rounds": 10,
        "kernels": {"gemm": {"us": 300.0, "n": 20}, "inject": {"us": 15.0, "n": 50}},
    }
    var["dflash@3"]["profile"] = {
        "rounds": 20,
        "kernels": {"gemm": {"us": 560.0, "n": 40}, "argmax": {"us": 4.0, "n": 20}},
    }
    doc.update(analyse(doc, {}, kernels))
    kd = doc["kernel_diff"]["3"]
    assert set(doc["kernel_diff"]) == {"3"}
    assert [r["kernel"] for r in kd["rows"]] == ["gemm", "inject", "argmax"]  # by |difference| per round
    assert kd["rows"][0]["diff_us"] == pytest.approx(30.0 - 28.0) and kd["rows"][1]["b_us"] == 0.0
    assert kd["rows"][1]["a_n"] == 5.0 and kd["total_diff_us"] == pytest.approx(31.5 - 28.2)
    md = scale_markdown({"shapes": {"qwen3-8b": doc}})
    assert "GPU kernels per round at c=1, τ=3" in md and "| inject | 1.5 (5.0) | 0.0 (0.0) | +1.5 |" in md


def test_kernel_times_read_a_real_profiler_trace(tmp_path):
    """torch.profiler's own Chrome trace (as SGLang's /start_profile writes it), plain and gzipped."""
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(7):
            torch.mm(a, b)
        torch.add(a, b)
    path = tmp_path / "rank0.trace.json"
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as f, gzip.open(tmp_path / "rank0.trace.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    k = kernel_times(path, cats=("cpu_op",))
    assert k["aten::mm"]["n"] == 7 and k["aten::mm"]["us"] > 0 and k["aten::add"]["n"] == 1
    assert kernel_times(tmp_path / "rank0.trace.json.gz", cats=("cpu_op",)) == k
    assert kernel_times(path) == {}  # a CPU run has no GPU kernels
    d = kernel_diff({"rounds": 7, "kernels": k}, {"rounds": 7, "kernels": {"aten::add": k["aten::add"]}}, top=1)
    assert d["rows"][0]["kernel"] == "aten::mm" and d["rows"][0]["a_n"] == 1.0 and d["rows"][0]["b_n"] == 0.0


def test_flags_are_replaced_not_doubled_and_kernel_figures_follow_the_width_rule(tmp_path):
    from shape_scale import SCALE_FLAGS, _kernels, _with

    flags = _with(["--max-total-tokens", "131072", "--sleep-on-idle"], SCALE_FLAGS)
    assert flags.count("--max-total-tokens") == 1 and flags[1] == "32768"
    assert flags[-2:] == ["--load-format", "dummy"]
    row = {
        "dtype": "bfloat16",
        "batch": 1,
        "eager_graph_ms": 0.15,
        "rows_graph_ms": 3.3,
        "split_graph_ms": 0.18,
        "transition_eager_graph_ms": 0.15,
        "transition_fused_graph_ms": 0.6,
        "head_topk_fused_graph_ms": 0.14,
        "head_argmax_graph_ms": 0.12,
    }
    for hidden, inj, trans in ((4096, "eager", 0.15), (576, "split", 0.6)):
        path = tmp_path / f"k{hidden}.json"
        path.write_text(json.dumps({"rows": [{**row, "hidden": hidden}]}))
        k = _kernels(str(path))
        assert (k["injection_variant"], k["transition_ms"]) == (inj, trans)
    # benches that record the path taken (the "gemm" layout on): its figures, whatever is faster elsewhere
    row = {**row, "gemm_graph_ms": 0.09, "transition_path_graph_ms": 0.1}
    for hidden, inj, how in ((4096, "gemm", "fused walk, eager scores"), (576, "split", "fused walk, fused scores")):
        path = tmp_path / f"p{hidden}.json"
        path.write_text(json.dumps({"rows": [{**row, "hidden": hidden, "injection_path": inj}]}))
        k = _kernels(str(path))
        assert (k["injection_variant"], k["transition_ms"], k["transition_variant"]) == (inj, 0.1, how)
