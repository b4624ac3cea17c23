"""adapt/finetuning.py: samples from trace token ids (loss exactly on the generated tokens), the episode split,
LoRA with and without the heads it would freeze, and a real Ray Train run (2 CPU workers) that ends where one
process ends. Tiny random Llama target and drafter, traces written in the collection format."""

import dataclasses
import json
import os
import random
import time

import pytest
import torch
from conftest import tiny_target
from safetensors.torch import load_file

from dspine.adapt.finetuning import (
    FinetuneConfig,
    add_lora,
    finetune,
    merge_lora,
    row_sample,
    split_episodes,
    worker_cpus,
)
from dspine.agents.base import TraceRow
from dspine.agents.traces import Store
from dspine.checkpoint import load_drafter, save_drafter
from dspine.drafter import DSpineDraftModel
from dspine.train.loop import TrainConfig
from dspine.train.losses import make_batch

P, C = 10, 12  # prompt and completion lengths: equal lengths make every sequence weigh the same in the loss


def _row(ep: str, turn: int, rng: random.Random, workload="tool", level="low", prompt=P, completion=C) -> TraceRow:
    return TraceRow(
        episode_id=ep,
        task_id="t",
        workload=workload,
        thinking=level,
        turn=turn,
        request_id=f"{ep}-{turn}",
        messages="[]",
        tools="[]",
        prompt_token_ids=[rng.randrange(1, 128) for _ in range(prompt)],
        completion_token_ids=[rng.randrange(1, 128) for _ in range(completion)],
        has_token_ids=True,
        completion_text="",
        tool_calls="[]",
        finish_reason="stop",
        prompt_tokens=prompt,
        completion_tokens=completion,
        accept_hist=[],
        tau=None,
        sampling="{}",
        target="tiny",
        drafter=None,
        chat_template_sha256=None,
        latency_s=0.0,
        ts=time.time(),
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    target = tiny_target("llama", dtype=torch.float64)
    target.model.save_pretrained(root / "target")
    base = DSpineDraftModel.for_target(target, method="dspine", num_hidden_layers=2, block_size=4, seed=0).double()
    save_drafter(base, root / "base")
    rng = random.Random(0)
    st = Store(str(root / "traces"))
    for e in range(4):
        st.write_rows([_row(f"ep{e}", t, rng) for t in range(2)], "traces", "tool", f"ep{e}.parquet")
    st.clean_tmp()
    return root


def _cfg(root, **kw) -> FinetuneConfig:
    train = TrainConfig(
        steps=3, batch_size=4, anchors_per_seq=C, max_len=64, lr=3e-3, warmup_steps=1, gamma=3.5, eval_every=100
    )
    return FinetuneConfig(
        traces=str(root / "traces"),
        out=str(root / kw.pop("name")),
        base=str(root / "base"),
        target=str(root / "target"),
        dtype="float64",
        heldout_fraction=0.0,
        validation_fraction=0.0,
        split="episode",
        train=train,
        **kw,
    )


def test_samples_mask_exactly_the_generated_tokens_and_episodes_split_whole():
    rng = random.Random(1)
    row = dataclasses.asdict(_row("e", 0, rng, prompt=30, completion=9))
    ids, start = row_sample(row, max_len=512)
    assert ids == row["prompt_token_ids"] + row["completion_token_ids"] and start == 30
    batch = make_batch([(ids, start)], anchors_per_seq=4, block_size=4, max_len=512, rng=random.Random(0))
    assert batch.label_mask[0].tolist() == [False] * 30 + [True] * 9
    # too long: the end is kept — the whole completion and the context nearest it
    ids, start = row_sample(row, max_len=16)
    assert len(ids) == 16 and ids[start:] == row["completion_token_ids"] and ids[:start] == row["prompt_token_ids"][-7:]
    assert row_sample({**row, "has_token_ids": False}, 512) is None
    assert row_sample({**row, "completion_token_ids": []}, 512) is None
    rows = [dataclasses.asdict(_row(f"ep{e}", t, rng)) for e in range(10) for t in range(3)]
    train, held = split_episodes(rows, 0.2, seed=0)
    assert len({r["episode_id"] for r in held}) == 2 and len(train) + len(held) == 30
    assert not {r["episode_id"] for r in held} & {r["episode_id"] for r in train}
    assert split_episodes(rows, 0.2, seed=0) == (train, held)  # seeded
    # by task: a task goes whole, at every level — 5 tasks × 2 levels × 2 episodes
    rows = [
        {**dataclasses.asdict(_row(f"ep{t}{lv}{k}", 0, rng, level=lv)), "task_id": f"t{t}"}
        for t in range(5)
        for lv in ("low", "high")
        for k in range(2)
    ]
    train, held = split_episodes(rows, 0.2, seed=0, by="task")
    assert {r["task_id"] for r in held} == {held[0]["task_id"]} and len(held) == 4
    assert {r["thinking"] for r in held} == {"low", "high"}
    assert not {r["task_id"] for r in held} & {r["task_id"] for r in train}
    train, held = split_episodes(rows, 0.2, seed=0)
    assert {r["task_id"] for r in held} & {r["task_id"] for r in train}  # by episode, a task falls on both sides


def test_lora_trains_the_heads_only_when_asked_and_merges_exactly(setup):
    base = load_file(str(setup / "base" / "model.safetensors"))
    heads = ("fc.weight", "hidden_norm.weight", "injections.1.write.weight")
    for name, save in (("lora_frozen", []), ("lora_heads", None)):
        kw = {"modules_to_save": save} if save is not None else {}
        res = finetune(_cfg(setup, name=name, mode="lora", workers=0, lora_rank=4, **kw), progress=False)
        got = load_file(str(setup / name / "all" / "model.safetensors"))
        assert set(got) == set(base) - {"transfer_codes"}  # merged: a plain checkpoint, no LoRA names
        q = "layers.0.self_attn.q_proj.weight"
        assert not torch.equal(got[q], base[q])  # the merged LoRA update
        changed = [h for h in heads if not torch.equal(got[h], base[h])]
        assert changed == ([] if save == [] else list(heads)), (name, changed)
        assert res["groups"]["all"]["train_samples"] == 8
    # blend: the same run saved at base + 0.4 · (adapted − base), weight by weight
    finetune(_cfg(setup, name="lora_blend", mode="lora", workers=0, lora_rank=4, blend=0.4), progress=False)
    blended = load_file(str(setup / "lora_blend" / "all" / "model.safetensors"))
    assert set(blended) == set(got)
    for k in got:
        assert torch.allclose(blended[k], base[k] + 0.4 * (got[k] - base[k]), atol=1e-12), k
    with pytest.raises(ValueError, match="blend"):
        _cfg(setup, name="x", blend=0.0).validate()
    # merge: a LoRA layer's output equals its merged plain layer's
    d = load_drafter(setup / "base")
    d = add_lora(d, _cfg(setup, name="x", mode="lora", lora_rank=4))
    lin = d.layers[0].self_attn.q_proj
    for p in (lin.lora_A["default"].weight, lin.lora_B["default"].weight):
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, lin.in_features, dtype=torch.float64)
    with torch.no_grad():
        want = lin(x)
        merge_lora(d)
        assert type(d.layers[0].self_attn.q_proj) is torch.nn.Linear
        assert torch.allclose(d.layers[0].self_attn.q_proj(x), want, atol=1e-10)
    with pytest.raises(ValueError, match="no module of the drafter is named"):
        add_lora(load_drafter(setup / "base"), _cfg(setup, name="x", mode="lora", target_modules=["qkv"]))


def _shipped_state_and_noise(target):
    """The shipped drafter's weights (a base state to blend toward) and a drafter of random weights."""
    from dspine.checkpoint import resolve_drafter

    shipped = load_drafter(resolve_drafter("builtin", "smollm2-135m-instruct"), target)
    state = {k: v.clone() for k, v in shipped.state_dict().items()}
    noise = load_drafter(resolve_drafter("builtin", "smollm2-135m-instruct"), target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in noise.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g, dtype=prm.dtype) * 0.02)
    return state, noise


def test_validation_picks_the_blend_by_replaying_its_rows(setup, smollm2, smollm2_pairs):
    """select_by=replay (the default): each blend choice is scored by the pooled τ of the validation rows replayed
    through the engine, as the test part is measured, and the best is saved and named. On the real target: the
    shipped drafter blended 1% toward random weights accepts; the random weights themselves do not."""
    from dspine.adapt.finetuning import choose_blend, replay_taus

    cfg = dataclasses.replace(_cfg(setup, name="sel", workers=0, blend_choices=[0.5, 1.0]), validation_fraction=0.25)
    finetune(cfg, progress=False)
    info = json.loads((setup / "sel" / "all" / "config.json").read_text())["dspine_training"]
    by, scores = info["blend_validation"]["by"], info["blend_validation"]["tau"]
    assert by == "replay" and set(scores) == {"0.5", "1.0"} and all(v >= 1.0 for v in scores.values())
    assert info["blend"] == max((1.0, 0.5), key=lambda a: (scores[str(a)], a))

    state, noise = _shipped_state_and_noise(smollm2)
    rows = [(ids[:start], ids[start:]) for ids, start in smollm2_pairs[:2]]
    real = dataclasses.replace(cfg, blend_choices=[0.01, 1.0])
    alpha, got = choose_blend(real, noise, state, smollm2, [rows[0]], rows)
    assert alpha == 0.01 and got["0.01"] > 1.5 and got["1.0"] < 1.1, got
    assert got["1.0"] == pytest.approx(replay_taus(smollm2, {"noise": noise}, rows)["noise"], abs=1e-4)
    with pytest.raises(ValueError, match="select_by"):
        _cfg(setup, name="x", select_by="loss").validate()


def test_the_general_check_keeps_a_regressing_blend_from_being_picked(setup, smollm2, smollm2_pairs):
    """general_validation: the blends are also replayed on the target's greedy answers to the gate benchmarks'
    last items; one that regresses more than max_general_regression below the base is never picked, however the
    agent rows score it, and when every one does the least regressing is kept."""
    from dspine.adapt.evaluation import BENCHMARKS
    from dspine.adapt.finetuning import allowed_blends, choose_blend, general_validation_rows
    from dspine.engine import Engine
    from dspine.sampling import SamplingParams
    from dspine.workloads import load_benchmark

    assert allowed_blends({0.5: 0.01, 1.0: 0.05}, 0.02) == [0.5]
    assert allowed_blends({0.5: 0.03, 0.7: 0.04, 1.0: 0.05}, 0.02) == [0.5]
    assert allowed_blends({0.5: -0.01, 1.0: 0.0}, 0.02) == [0.5, 1.0]

    rows, groups = general_validation_rows(smollm2, 1, 6)
    assert groups == list(BENCHMARKS)
    for (prompt, answer), b in zip(rows, groups):
        last = load_benchmark(b)[-1]  # the gate reads the first items
        assert last.turns[0] != load_benchmark(b, 1)[0].turns[0]
        assert prompt == Engine(smollm2, None).prompt_ids(last.turns[0])  # as the gate's engine renders it
        want = Engine(smollm2, None).generate(prompt, SamplingParams(max_tokens=6, temperature=0.0)).token_ids
        assert answer == list(want)

    state, noise = _shipped_state_and_noise(smollm2)
    agent = [(ids[:start], ids[start:]) for ids, start in smollm2_pairs[:1]]
    cfg = dataclasses.replace(
        _cfg(setup, name="gen", workers=0, blend_choices=[0.01, 1.0]), general_validation=1, general_max_new_tokens=16
    )
    alpha, report = choose_blend(cfg, noise, state, smollm2, agent, agent)
    reg = report["general_regression"]
    assert reg["1.0"] > 0.3 and abs(reg["0.01"]) < 0.1, report  # random weights lose the base's general τ
    assert report["allowed"] == ["0.01"] and alpha == 0.01 and report["general_rows"] == len(BENCHMARKS)
    assert set(report["agent"]) == {"0.01", "1.0"} and report["general"]["base"] > 1.5
    with pytest.raises(ValueError, match="select_by=replay"):
        dataclasses.replace(cfg, select_by="tau_sim").validate()


def test_ray_train_two_workers_end_where_one_process_ends(setup):
    import ray

    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    one = finetune(_cfg(setup, name="one", workers=0), progress=False)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        # a pause after every step: each reports a Ray checkpoint, and the run continues exactly
        two = finetune(_cfg(setup, name="two", workers=2, report_every_s=1e-6), progress=False)
        # one worker on the 2-CPU cluster: Ray reserves both CPUs for it, and it trains on two threads
        # (Ray's default, one CPU a worker, would have left it one thread)
        wide = finetune(_cfg(setup, name="wide", workers=1), progress=False)
        assert (worker_cpus(1), worker_cpus(2), worker_cpus(3)) == (2, 1, 1)
    finally:
        ray.shutdown()
    assert (two["groups"]["all"]["last"]["threads"], wide["groups"]["all"]["last"]["threads"]) == (1, 2)
    a, b = (load_file(str(setup / n / "all" / "model.safetensors")) for n in ("one", "two"))
    base = load_file(str(setup / "base" / "model.safetensors"))
    assert set(a) == set(b)
    assert all(torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4) for k in a)
    assert not torch.equal(a["injections.1.write.weight"], base["injections.1.write.weight"])  # it trained
    assert one["groups"]["all"]["train_samples"] == two["groups"]["all"]["train_samples"] == 8
    assert json.loads((setup / "two" / "finetune.json").read_text())["config"]["workers"] == 2
    assert (one["groups"]["all"]["last"]["processes"], two["groups"]["all"]["last"]["processes"]) == (1, 2)
    assert two["groups"]["all"]["last"]["step"] == 3
    ckpts = [p for p in (setup / "two" / "ray" / "finetune-all").iterdir() if p.name.startswith("checkpoint")]
    assert len(ckpts) >= 3, ckpts  # two pauses and the final merged drafter, through ray.train.report


def test_held_out_replay_and_the_gate_on_real_figures(setup, tmp_path):
    """A drafter fine-tuned on episodes whose content the held-out episodes repeat is accepted over a random
    base; the same pair swapped (the random one as the 'adapted') is refused."""
    from dspine.adapt.evaluation import EvalConfig, evaluate_adaptation
    from dspine.engine import Engine
    from dspine.sampling import SamplingParams
    from dspine.target import load_target

    rng = random.Random(3)
    contents = [_row("c", 0, rng) for _ in range(3)]
    st = Store(str(tmp_path / "traces"))
    for e in range(6):
        c = contents[e % 3]
        st.write_rows(
            [dataclasses.replace(c, episode_id=f"ep{e}", request_id=f"r{e}")], "traces", "tool", f"ep{e}.parquet"
        )
    st.clean_tmp()
    cfg = dataclasses.replace(
        _cfg(setup, name="x"),
        traces=str(tmp_path / "traces"),
        out=str(tmp_path / "ft"),
        workers=0,
        heldout_fraction=0.34,
    )
    cfg.train = dataclasses.replace(cfg.train, steps=40, batch_size=2)
    ft = finetune(cfg, progress=False)
    assert len(ft["groups"]["all"]["heldout_episodes"]) == 2 and ft["groups"]["all"]["train_samples"] == 4
    assert ft["groups"]["all"]["test_tasks"] == ["tool:t"]  # what a later run (the agent race) must hold out too
    doc = evaluate_adaptation(
        EvalConfig(finetune=str(tmp_path / "ft"), out=str(tmp_path / "adapt.json"), limit=0, min_rows=1, min_tasks=1),
        progress=False,
    )
    cell = doc["per_cell"]["tool/low"]
    assert cell["rows"] == 2 and cell["ratio"] == pytest.approx(cell["adapted"] / cell["base"])
    assert cell["ratio"] > 1.2 and doc["gate"]["all"] == {"accept": True, "reasons": []}
    # the replay is the engine's on the exact recorded tokens
    target = load_target(cfg.target, dtype=torch.float64)
    held = [c for e, c in enumerate(contents * 2) if f"ep{e}" in ft["groups"]["all"]["heldout_episodes"]]
    eng = Engine(target, load_drafter(ft["groups"]["all"]["drafter"], target))
    direct = [eng.generate(r.prompt_token_ids, SamplingParams(), forced=r.completion_token_ids).stats for r in held]
    merged = direct[0].merge(direct[1])
    assert cell["adapted"] == pytest.approx(merged.tau) and cell["rounds"]["adapted"] == merged.rounds
    assert (tmp_path / "adapt.md").read_text().count("tool/low") == 1
    info = doc["drafters"]["all"]  # every row has task "t": the held-out task was trained on
    assert (info["split"], info["heldout_tasks"], info["heldout_tasks_seen"]) == ("episode", 1, 1)
    # general benchmarks that fail to run (an unknown one) leave the replay written, the drafter refused meanwhile
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        evaluate_adaptation(
            EvalConfig(
                finetune=str(tmp_path / "ft"),
                out=str(tmp_path / "cut.json"),
                limit=1,
                benchmarks=["nope"],
                min_rows=1,
                min_tasks=1,
            ),
            progress=False,
        )
    cut = json.loads((tmp_path / "cut.json").read_text())
    assert cut["per_cell"] == json.loads(json.dumps(doc["per_cell"])) and cut["general"] is None
    assert cut["gate"]["all"] == {"accept": False, "reasons": ["general benchmarks pending"]}
    # swapped: the random drafter as the candidate is refused, with its figure
    swapped = json.loads((tmp_path / "ft" / "finetune.json").read_text())
    swapped["config"]["base"], swapped["groups"]["all"]["drafter"] = (
        swapped["groups"]["all"]["drafter"],
        str(setup / "base"),
    )
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "finetune.json").write_text(json.dumps(swapped))
    bad = evaluate_adaptation(
        EvalConfig(finetune=str(tmp_path / "sw"), limit=0, min_rows=1, min_tasks=1), progress=False
    )
    assert bad["per_cell"]["tool/low"]["ratio"] == pytest.approx(1 / cell["ratio"])
    assert not bad["gate"]["all"]["accept"] and "tool/low: τ ratio" in bad["gate"]["all"]["reasons"][0]


def test_mixing_in_regenerated_data_holds_its_share(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dspine.adapt.finetuning import mix_in

    rng = random.Random(5)
    general = [([rng.randrange(128) for _ in range(40)], [rng.randrange(128) for _ in range(30)]) for _ in range(20)]
    (tmp_path / "regen").mkdir()
    pq.write_table(
        pa.table({"prompt_ids": [p for p, _ in general], "response_ids": [r for _, r in general]}),
        tmp_path / "regen" / "part-00000.parquet",
    )
    traces = [([1] * 20, 10)] * 6
    cfg = dataclasses.replace(_cfg(tmp_path, name="m"), mix=str(tmp_path / "regen"), mix_fraction=0.5)
    cfg.train = dataclasses.replace(cfg.train, max_len=64)
    out = mix_in(traces, cfg)
    assert out[:6] == traces and len(out) == 12  # half of the result is general data
    whole = {tuple(p + r) for p, r in general}
    for ids, start in out[6:]:  # each a regenerated sample, its end kept within max_len, loss on its response
        assert len(ids) == 64 and start == 40 - 6 and any(t[-64:] == tuple(ids) for t in whole)
    assert mix_in(traces, dataclasses.replace(cfg, mix_fraction=0.0)) == traces
    with pytest.raises(ValueError, match="mix_fraction > 0 needs mix"):
        dataclasses.replace(cfg, mix="").validate()
