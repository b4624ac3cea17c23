"""The GPU loop's pure parts (bench/experiments/gpu_loop.py) and the SGLang 0.5.17 acceptance fields it relies on:
collections merged without loss, the proxy's store read per cell, a scrambled drafter that still loads, and
per-choice `meta_info` / token ids read from SGLang-shaped replies. The loop itself runs on the GPU machine
(bench/results/gpu_loop.md) and, against `dspine serve`, as a rehearsal (`--backend dspine`)."""

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dspine.agents.base import TraceRow
from dspine.agents.traces import Store, load_traces, shard
from dspine.serve.litellm_hooks import acceptance_from_response, reply_ids
from dspine.stats import AcceptanceStats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "experiments"))
import gpu_loop


def _row(ep: str, workload: str, turn: int, hist: list[int], rng: random.Random) -> TraceRow:
    return TraceRow(
        episode_id=ep,
        task_id=f"task-{ep}",
        workload=workload,
        thinking="none",
        turn=turn,
        request_id=f"{ep}-{turn}",
        messages="[]",
        tools="[]",
        prompt_token_ids=[rng.randrange(1, 99) for _ in range(12)],
        completion_token_ids=[rng.randrange(1, 99) for _ in range(5)],
        has_token_ids=True,
        completion_text="",
        tool_calls="[]",
        finish_reason="stop",
        prompt_tokens=12,
        completion_tokens=5,
        accept_hist=hist,
        tau=None,
        sampling="{}",
        target="tiny",
        drafter=None,
        chat_template_sha256=None,
        latency_s=0.1,
        ts=0.0,
    )


def _collection(root: Path, workload: str, episodes: int, rng) -> None:
    st = Store(str(root))
    for e in range(episodes):
        ep = f"{workload}-{e}"
        rows = [_row(ep, workload, t, [1, 2, 0, 1], rng) for t in range(3)]
        st.write_rows(rows, *shard(workload, ep))
        st.write_json({"episode_id": ep}, "episodes", f"{ep}.json")


def test_merged_collections_keep_every_row_and_count_per_cell(tmp_path):
    rng = random.Random(0)
    _collection(tmp_path / "live", "tool", 2, rng)
    _collection(tmp_path / "replay", "swe_replay", 3, rng)
    rows = gpu_loop.merge_collections([tmp_path / "live", tmp_path / "replay", tmp_path / "absent"], tmp_path / "all")
    assert rows == {"tool": 6, "swe_replay": 9}
    assert len(load_traces(str(tmp_path / "all"))) == 15
    assert len(list((tmp_path / "all" / "episodes").glob("*.json"))) == 5
    fig = gpu_loop.trace_figures(tmp_path / "all", 60.0)
    assert fig["episodes"] == 5 and fig["episodes_per_min"] == 5.0
    tool = fig["cells"]["tool/none"]
    assert (tool["episodes"], tool["rows"], tool["rows_with_ids"], tool["tokens"]) == (2, 6, 6, 30)
    # hist [1, 2, 0, 1] per row: 4 rounds, 5 accepted drafts -> τ (5 + 4) / 4
    assert tool["tau_recorded"] == pytest.approx(2.25)


def test_store_cells_pool_only_requests_with_acceptance():
    rows = [
        {"workload": "tool", "thinking": "low", "accept_hist": [0, 2, 2]},
        {"workload": "tool", "thinking": "low", "accept_hist": None},
        {"workload": "swe", "thinking": "high", "accept_hist": [4, 0, 0]},
    ]
    out = gpu_loop.store_cells(rows)
    assert out["tool/low"] == {"requests": 2, "with_acceptance": 1, "tau": pytest.approx(2.5)}
    assert out["swe/high"]["tau"] == 1.0
    assert list(out) == ["swe/high", "tool/low"]


def test_scrambled_drafter_keeps_names_shapes_and_dtypes(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "d"
    src.mkdir()
    (src / "config.json").write_text("{}")
    sd = {"a.weight": torch.ones(4, 3, dtype=torch.bfloat16), "b": torch.ones(2)}
    save_file(sd, str(src / "model.safetensors"))
    gpu_loop.scramble_drafter(str(src), tmp_path / "broken")
    got = load_file(str(tmp_path / "broken" / "model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in sd.items()}
    assert not torch.equal(got["a.weight"], sd["a.weight"])
    assert (tmp_path / "broken" / "config.json").read_text() == "{}"


def test_sglang_histogram_is_widened_to_the_block():
    # SGLang 0.5.17's histogram reaches only the largest count seen; the block is proposed / rounds + 1
    meta = {"spec_verify_ct": 5, "spec_num_proposed_drafts": 75, "spec_correct_drafts_histogram": [1, 2, 0, 2]}
    st = AcceptanceStats.from_sglang_meta(meta)
    assert st.block_size == 16 and st.accept_hist[:5] == [1, 2, 0, 2, 0] and len(st.accept_hist) == 16
    assert st.tau == pytest.approx((2 + 6 + 5) / 5)
    assert AcceptanceStats.from_sglang_meta({"spec_verify_ct": 5}) is None
    assert AcceptanceStats.from_sglang_meta(None) is None
    ours = AcceptanceStats(4, [1, 0, 3, 0])  # dspine serve's fields come back whole
    assert AcceptanceStats.from_sglang_meta(ours.sglang_meta()) == ours


def test_proxy_reads_acceptance_and_ids_from_an_sglang_choice():
    meta = {"spec_verify_ct": 2, "spec_num_proposed_drafts": 6, "spec_correct_drafts_histogram": [0, 2]}
    choice = SimpleNamespace(provider_specific_fields={"meta_info": meta, "prompt_token_ids": [5, 6], "token_ids": [7]})
    resp = SimpleNamespace(choices=[choice], model_extra={})
    got = acceptance_from_response(resp)
    assert got["spec_correct_drafts_histogram"] == [0, 2, 0, 0]
    assert reply_ids(resp, "prompt_token_ids") == [5, 6] and reply_ids(resp, "token_ids") == [7]
    bare = SimpleNamespace(choices=[SimpleNamespace()], model_extra={})
    assert acceptance_from_response(bare) is None and reply_ids(bare, "token_ids") is None
    top = AcceptanceStats(3, [1, 1, 1])  # a top-level meta_info (dspine serve) wins over the choice's
    resp2 = SimpleNamespace(choices=[choice], model_extra={}, meta_info=top.sglang_meta())
    assert acceptance_from_response(resp2)["spec_correct_drafts_histogram"] == [1, 1, 1]


def test_a_backend_that_died_is_started_again_on_its_port(tmp_path):
    """ensure_backend: a backend that does not answer is started again from its recorded command on the same port
    (the proxy's route stays valid), and the restart is counted."""
    import json
    import urllib.request

    from dspine.adapt.deployment import stop_backend
    from dspine.process import free_port

    port = free_port()
    work = tmp_path / "w"
    work.mkdir()
    cmd = f"{sys.executable} -m dspine.cli serve --drafter none --served-model-name smol --port {port}"
    (work / "state.json").write_text(json.dumps({"backend_port": port, "admin_key": "k" * 16}))
    (work / "backend.json").write_text(json.dumps({"pid": 1, "command": cmd, "drafter": "none"}))
    (work / "backend.log").write_text("ValueError: pool memory leak detected!\n")
    loop = gpu_loop.Loop(gpu_loop.parse(["replay", "--work", str(work), "--backend", "dspine", "--device", "cpu"]))
    try:
        loop.ensure_backend()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == "smol"
        assert [x["log"] for x in loop.result["backend_restarts"]] == [["ValueError: pool memory leak detected!"]]
        loop.ensure_backend()  # it answers now: nothing more
        assert len(loop.result["backend_restarts"]) == 1
    finally:
        stop_backend(json.loads((work / "backend.json").read_text()))


def test_finetune_settings_replace_the_recipe_and_malformed_ones_are_refused(tmp_path, monkeypatch):
    a = gpu_loop.parse(["adapt", "--work", str(tmp_path), "--finetune-set", "train.max_len=4096"])
    loop = gpu_loop.Loop(a)
    loop.state["base_drafter"] = "x"
    seen = {}

    def job(args, name):
        seen["args"] = args
        return 1  # a failed fine-tune: the stage stops before the evaluation

    monkeypatch.setattr(loop, "ray_job", job)
    with pytest.raises(SystemExit):
        loop.adapt()
    assert "train.max_len=4096" in seen["args"] and "train.max_len=2048" not in seen["args"]
    assert "train.lr=0.0001" in seen["args"]
    with pytest.raises(SystemExit):
        gpu_loop.parse(["adapt", "--finetune-set", "train.max_len"])


def test_replicas_are_one_proxy_model_beside_the_first_alone_and_their_scaling_is_read_from_the_two_runs():
    assert gpu_loop.proxy_backends("smol", [8001]) == ["smol=http://127.0.0.1:8001/v1@smol"]
    got = gpu_loop.proxy_backends("smol", [8001, 8002, 8003])
    assert got == [
        "smol=http://127.0.0.1:8001/v1@smol",
        "smol=http://127.0.0.1:8002/v1@smol",
        "smol=http://127.0.0.1:8003/v1@smol",
        "smol-1=http://127.0.0.1:8001/v1@smol",
    ]
    from dspine.serve.proxy import ProxyConfig, api_bases, parse_backend

    cfg = ProxyConfig(backends=[parse_backend(b) for b in got])
    cfg.validate()  # replicas of one name are accepted; each name's bases are where its records are read
    assert api_bases(cfg) == {
        "smol": [f"http://127.0.0.1:{p}/v1" for p in (8001, 8002, 8003)],
        "smol-1": ["http://127.0.0.1:8001/v1"],
    }
    runs = {"1": {"rc": 0, "episodes_per_min": 10.0}, "3": {"rc": 0, "episodes_per_min": 27.0}}
    sc = gpu_loop.replica_scaling(runs, 3)
    assert sc["speedup"] == 2.7 and sc["efficiency"] == 0.9 and sc["runs"] is runs
    assert (
        gpu_loop.replica_scaling({"1": {"episodes_per_min": 0.0}, "2": {"episodes_per_min": 5.0}}, 2)["speedup"] is None
    )
    assert "efficiency 0.9" in gpu_loop.markdown({"replicas": sc})
    with pytest.raises(SystemExit):
        gpu_loop.parse(["up", "--replicas", "0"])


def test_replayed_prefixes_stay_clear_of_sglangs_dflash_reserve_at_the_context_boundary(tmp_path):
    """SGLang 0.5.17's DFLASH reserves two blocks past a request's tokens; a request ending within them of the context
    boundary leaks KV slots (sglang#33579): the collection's window leaves them free on SGLang, not on dspine serve."""
    loop = gpu_loop.Loop(gpu_loop.parse(["collect", "--work", str(tmp_path), "--context", "8192"]))
    loop.state["block_size"] = 16
    assert loop.window() == 8192 - 32
    rehearsal = gpu_loop.Loop(gpu_loop.parse(["collect", "--work", str(tmp_path / "d"), "--backend", "dspine"]))
    assert rehearsal.window() == 8192
