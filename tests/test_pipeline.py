"""regen -> train -> eval on the real target at CPU size: accounting, resume, errors, the tiny recipe."""

import dataclasses
import json
import os
import stat

import pytest
import torch

from dspine.checkpoint import load_drafter
from dspine.cli import main
from dspine.config import ConfigError
from dspine.train.data import RegenError, load_samples, regenerate_dataset


@pytest.fixture(scope="module")
def regen_dir(tmp_path_factory, smollm2):
    out = tmp_path_factory.mktemp("regen")
    items = [("a", "Name a fruit."), ("b", "   "), ("c", "What is 2 + 2?"), ("d", "Say hello in French.")]
    rep = regenerate_dataset(smollm2, items, out, max_new_tokens=12, batch_size=2, progress=False)
    assert (rep.input, rep.ok, rep.error, rep.skipped) == (4, 3, 1, 0)
    return out


def test_regen_accounts_and_resumes(regen_dir, smollm2):
    errors = [json.loads(line) for line in (regen_dir / "errors.jsonl").read_text().splitlines()]
    assert errors == [{"id": "b", "error": "empty prompt"}]
    items = [("a", "Name a fruit."), ("c", "What is 2 + 2?"), ("e", "Name a colour.")]
    rep = regenerate_dataset(smollm2, items, regen_dir, max_new_tokens=12, batch_size=2, progress=False)
    assert (rep.input, rep.ok, rep.error, rep.skipped) == (3, 1, 0, 2)
    manifest = json.loads((regen_dir / "manifest.json").read_text())
    assert manifest["answered_total"] == 4 and manifest["ok"] + manifest["error"] + manifest["skipped"] == 3
    pairs = load_samples(regen_dir)
    assert len(pairs) == 4 and all(0 < start < len(ids) for ids, start in pairs)
    assert not [p for p in os.listdir(regen_dir) if p.startswith(".")]  # no temp files left


def test_regen_matches_engine_greedy(regen_dir, smollm2):
    """The batched regen is the target's own greedy continuation (what the drafter must learn)."""
    import pyarrow.parquet as pq

    from dspine.engine import Engine
    from dspine.sampling import SamplingParams

    rows = pq.read_table(sorted(regen_dir.glob("part-*.parquet"))[0]).to_pylist()
    row = next(r for r in rows if r["id"] == "a")
    res = Engine(smollm2).generate(row["prompt_ids"], SamplingParams(max_tokens=12))
    assert res.token_ids == row["response_ids"][: len(res.token_ids)]


def test_regen_halves_a_batch_out_of_memory(tmp_path, smollm2, monkeypatch):
    """A batch the GPU cannot hold is answered in halves (down to one row), not lost. The out-of-memory is
    injected: a CPU cannot be made to run out of memory at a chosen batch size."""
    import pyarrow.parquet as pq

    items = [("a", "Name a fruit."), ("c", "What is 2 + 2?"), ("d", "Say hello in French.")]
    one = regenerate_dataset(smollm2, items, tmp_path / "one", max_new_tokens=6, batch_size=1, progress=False)
    real, rows = smollm2.model.generate, []

    def generate(*args, input_ids, **kw):
        rows.append(len(input_ids))
        if len(input_ids) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*args, input_ids=input_ids, **kw)

    monkeypatch.setattr(smollm2.model, "generate", generate)
    rep = regenerate_dataset(smollm2, items, tmp_path / "oom", max_new_tokens=6, batch_size=3, progress=False)
    assert (rep.ok, rep.error) == (3, 0) == (one.ok, one.error)
    assert rows == [3, 1, 2, 1, 1]
    answers = [
        {r["id"]: r["response_ids"] for r in pq.read_table(sorted((tmp_path / d).glob("part-*"))[0]).to_pylist()}
        for d in ("one", "oom")
    ]
    assert answers[0] == answers[1]


def test_workload_ids_stay_when_the_recipe_grows():
    """A prompt's regeneration id names its pool and its place there: a larger limit or another pool joined
    adds ids and keeps the old ones on the same prompts (a resumed regeneration answers only the new)."""
    from dspine.train.data import workload_items

    small = dict(workload_items("gsm8k_train+mbpp_train", limit=3, suffix="@T1"))
    large = dict(workload_items("sharegpt+gsm8k_train+mbpp_train", limit=5, suffix="@T1"))
    assert list(small) == [f"{p}/{i}@T1" for p in ("gsm8k_train", "mbpp_train") for i in range(3)]
    assert len(large) == 15 and all(large[i] == small[i] for i in small)


def test_packed_data_trains_and_resumes_like_the_original(regen_dir, tmp_path, smollm2):
    """The compact copy a GPU run carries home: same samples in the same order, every prompt counted as
    answered, parts within the size asked, refusing to pack over other files."""
    import pyarrow.parquet as pq

    from dspine.train.data import existing_ids, pack_dataset

    whole = pack_dataset(regen_dir, tmp_path / "one")[0].stat().st_size  # one part at the default limit
    files = pack_dataset(regen_dir, tmp_path / "p", max_bytes=whole - 1)
    parts = sorted((tmp_path / "p").glob("part-*.parquet"))
    assert len(parts) > 1 and all(p.stat().st_size < whole for p in parts)
    assert {f.name for f in files} >= {"manifest.json", "errors.jsonl"}
    assert load_samples(tmp_path / "p") == load_samples(regen_dir)
    assert existing_ids(tmp_path / "p") == existing_ids(regen_dir)
    assert str(pq.read_schema(parts[0]).field("response_ids").type) == "list<element: uint16>"
    items = [(i, "unused") for i in sorted(existing_ids(regen_dir))]
    rep = regenerate_dataset(smollm2, items, tmp_path / "p", max_new_tokens=12, progress=False)
    assert (rep.ok, rep.skipped) == (0, len(items))
    # regeneration goes on in a packed set (a staged run answering new prompts): it packs again, all rows kept
    more = [*items, ("z", "Name a color.")]
    rep = regenerate_dataset(smollm2, more, tmp_path / "p", max_new_tokens=12, progress=False)
    assert (rep.ok, rep.skipped) == (1, len(items))
    pack_dataset(tmp_path / "p", tmp_path / "p2")
    assert existing_ids(tmp_path / "p2") == existing_ids(regen_dir) | {"z"}
    assert load_samples(tmp_path / "p2")[: len(load_samples(regen_dir))] == load_samples(regen_dir)
    with pytest.raises(RegenError, match="not empty"):
        pack_dataset(regen_dir, tmp_path / "p")
    with pytest.raises(RegenError, match="no regenerated data"):
        pack_dataset(tmp_path / "nothing", tmp_path / "q")


def test_regen_errors(tmp_path, smollm2):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IREAD | stat.S_IEXEC)
    if os.access(ro, os.W_OK):  # root ignores permission bits: use a path under a file instead
        ro = tmp_path / "file"
        ro.write_text("x")
        ro = ro / "sub"
    with pytest.raises(RegenError, match="cannot write"):
        regenerate_dataset(smollm2, [("a", "hi")], ro, progress=False)
    with pytest.raises(RegenError, match="no regenerated data"):
        load_samples(tmp_path)


def test_train_resume_equals_straight_run(regen_dir, tmp_path):
    common = [
        "train",
        "--data",
        str(regen_dir),
        "--layers",
        "1",
        "--block-size",
        "4",
        "--no-progress",
        "train.batch_size=2",
        "train.anchors_per_seq=3",
        "train.eval_every=2",
        "train.warmup_steps=1",
    ]
    assert main(common + ["--out", str(tmp_path / "straight"), "train.steps=4"]) == 0
    assert main(common + ["--out", str(tmp_path / "split"), "train.steps=2"]) == 0
    assert main(common + ["--out", str(tmp_path / "split"), "--resume", "train.steps=4"]) == 0
    a = load_drafter(tmp_path / "straight" / "last").state_dict()
    b = load_drafter(tmp_path / "split" / "last").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "split" / "best" / "config.json").is_file()
    # warm start copies weights only: a new run from the straight run's weights
    assert (
        main(
            common
            + [
                "--out",
                str(tmp_path / "warm"),
                "--warm-start",
                str(tmp_path / "straight" / "last"),
                "train.steps=1",
                "train.lr=1e-12",
            ]
        )
        == 0
    )
    c = load_drafter(tmp_path / "warm" / "last").state_dict()
    assert torch.allclose(c["fc.weight"], a["fc.weight"], atol=1e-6)


def test_train_and_eval_errors(tmp_path, regen_dir, capsys):
    assert main(["train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "no regenerated data" in capsys.readouterr().err
    assert main(["train", "--data", str(regen_dir), "--out", str(tmp_path / "o"), "train.lrate=1"]) == 2
    assert "unknown key" in capsys.readouterr().err
    assert main(["train", "--data", str(regen_dir), "--out", str(tmp_path / "o2"), "--resume"]) == 2
    assert "no trainer state" in capsys.readouterr().err
    assert main(["eval", "--benchmarks", "gsm9k", "--out", str(tmp_path / "e.json")]) == 2
    assert "unknown benchmark" in capsys.readouterr().err
    assert main(["eval", "--drafter", f"x={tmp_path}", "--out", str(tmp_path / "e.json")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_eval_refuses_checkpoint_for_another_target(tmp_path, capsys):
    from conftest import tiny_target

    from dspine.checkpoint import save_drafter
    from dspine.drafter import DSpineDraftModel

    path = save_drafter(DSpineDraftModel.for_target(tiny_target("llama"), num_hidden_layers=1), tmp_path / "t")
    assert (
        main(
            [
                "eval",
                "--drafter",
                f"x={path}",
                "--benchmarks",
                "gsm8k",
                "--limit",
                "1",
                "--out",
                str(tmp_path / "e.json"),
            ]
        )
        == 2
    )
    assert "vocab 128" in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


@pytest.mark.slow  # ~5 min on two cores: the GPU recipe's stages at CPU size (`make test-all`)
def test_tiny_recipe_end_to_end(tmp_path):
    """The GPU recipe at CPU size: every trained drafter beats its untrained self and stays lossless."""
    from dspine.io import update_summary
    from dspine.train.recipe import (
        RecipeConfig,
        acceptance_summary,
        lineage_chart,
        lineage_curve,
        run_eval_stage,
        run_train_stage,
    )

    cfg = dataclasses.replace(RecipeConfig.cpu_tiny(), added_workload="mbpp_fn")  # a pool joined later
    rep = run_train_stage(cfg, tmp_path, progress=False)
    assert rep["heldout"] == cfg.heldout and 0 < rep["added_samples"] <= 40 and rep["regen_data_added"]["ok"] == 40
    for m, r in rep["methods"].items():
        assert r["best_tau_sim"] > r["tau_sim_before"], (m, r)
    assert set(rep["methods"]) == {"dflash", "post_backbone", "dspine", "dspine_nocos"}
    # the curve across runs that continued one another: the second run's points after the first's sequences
    n, seen = len(rep["methods"]["dspine"]["eval_curve"]), rep["train"]["sequences"] / 1000
    cur = lineage_curve([rep, rep])
    assert len(cur["x"]) == 2 * n and cur["x"][n] == pytest.approx(seen + cur["x"][0])
    assert cur["dspine"][:n] == cur["dspine"][n:] and cur["dspine"] != cur["dflash"]
    svg = lineage_chart([rep, rep], ["a", "b"])
    assert svg.count("<polyline") == 2 and "(a → b)" in svg
    pts = [float(xy.split(",")[0]) for xy in svg.split('points="')[1].split('"')[0].split()]
    rel = lambda v: [(t - v[0]) / (v[-1] - v[0]) for t in v]  # points placed to scale in x
    assert rel(pts) == pytest.approx(rel(cur["x"]), abs=2e-3)
    # plus the dspine drafter decoded with a 2-wide walk, and every method through one draft tree
    cfg = dataclasses.replace(cfg, eval_top_k=[2], eval_trees={"t": "00.1"})
    doc = run_eval_stage(cfg, tmp_path, tmp_path / "acc.json", progress=False)
    # two engine processes give the very same tokens and acceptance as one
    par = run_eval_stage(dataclasses.replace(cfg, eval_workers=2), tmp_path, tmp_path / "par.json", progress=False)
    strip = lambda d: {
        b: {T: {m: {k: v for k, v in r.items() if k != "seconds"} for m, r in c.items()} for T, c in bt.items()}
        for b, bt in d["results"].items()
    }
    assert strip(par) == strip(doc)
    md = (tmp_path / "acc.md").read_text()
    assert "Held-out simulated" in md and "Per-slot acceptance at T = 0" in md
    svg = (tmp_path / "acc.svg").read_text()  # the per-slot chart: a line per drafter and panel (T = 0: 2 panels)
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 * 7
    assert all(f"<title>{m}</title>" in svg for m in ("dflash", "post_backbone", "dspine", "dspine_k2", "dflash_t"))
    assert "τ(dspine_t) / τ(dflash_t) at T0" in md and doc["draft_trees"]["post_backbone_t"] == "00.1"
    with pytest.raises(ConfigError, match="eval_trees.t: draft tree '0a'"):
        dataclasses.replace(cfg, eval_trees={"t": "0a"}).validate()
    for bench in doc["results"].values():
        for m, r in bench["T0"].items():
            if m != "ar":
                ok, n = map(int, r["exact_match_with_ar"].split("/"))
                assert ok == n
    update_summary(tmp_path / "summary.json", "acceptance", acceptance_summary(doc))
    update_summary(tmp_path / "summary.json", "load", {"clients": 1})
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["acceptance"]["T0"]["ar"] == 1.0
    assert set(s["acceptance"]["T0"]) == {"ar", "dflash", "post_backbone", "dspine", "dspine_k2"} | {
        f"{m}_t" for m in ("dflash", "post_backbone", "dspine")
    }
    assert s["load"] == {"clients": 1} and (tmp_path / "acc.md").is_file()
    # the replay evaluation of the same drafters: T = 0 on the target's greedy answers, the pair's ratio with an
    # interval over items, every drafter on the run's own held-out anchors
    rcfg = dataclasses.replace(cfg, eval_mode="replay", eval_top_k=[], eval_trees={}, eval_limit=2)
    rdoc = run_eval_stage(rcfg, tmp_path, tmp_path / "rep.json", progress=False)
    assert set(rdoc["pairs"]) == {"dspine"} and rdoc["pairs"]["dspine"]["twin"] == "dflash"
    assert rdoc["pairs"]["dspine"]["items"] == 4 and set(rdoc["heldout"]) == {"dflash", "post_backbone", "dspine"}
    for n, h in rdoc["heldout"].items():  # the trained drafters on the held-out anchors training drew
        assert len(h["slot_acc"]) == cfg.block_size - 1 and h["tau_sim"] > 1.0, n
    assert "Over the twin" in (tmp_path / "rep.md").read_text() and (tmp_path / "rep.svg").is_file()
    assert acceptance_summary(rdoc)["best_pair"] == "dspine"


def test_eval_first_turns_only(smollm2):
    """`--turns 1` asks MT-Bench's first turn only, as a single-turn server benchmark does."""
    from dspine.drafter import DSpineDraftModel
    from dspine.eval.acceptance import evaluate

    d = DSpineDraftModel.for_target(smollm2, method="dspine", num_hidden_layers=1)
    both = evaluate(smollm2, {"d": d}, ["mt_bench"], 1, [0.0], 8, progress=False)
    first = evaluate(smollm2, {"d": d}, ["mt_bench"], 1, [0.0], 8, progress=False, max_turns=1)
    tok = lambda doc, m: doc["results"]["mt_bench"]["T0"][m]["tokens"]
    assert tok(first, "ar") == tok(first, "d") == 8 and tok(both, "ar") == 16
    assert first["max_turns"] == 1 and first["results"]["mt_bench"]["T0"]["d"]["exact_match_with_ar"] == "1/1"


def test_eval_through_a_draft_tree(smollm2, tmp_path, capsys):
    """`--draft-tree NAME=TREE`: that drafter's rounds verify the tree (still AR's tokens at T0), the
    others the chain; bad trees are refused by name before any decoding."""
    from dspine.checkpoint import load_drafter
    from dspine.drafters import builtin_drafter
    from dspine.eval.acceptance import evaluate, markdown_table

    d = load_drafter(builtin_drafter("smollm2-135m-instruct"), smollm2, dtype=torch.float32)
    doc = evaluate(smollm2, {"chain": d, "tree": d}, ["gsm8k"], 1, [0.0], 24, progress=False, trees={"tree": "0000.1"})
    cell = doc["results"]["gsm8k"]["T0"]
    assert cell["chain"]["exact_match_with_ar"] == cell["tree"]["exact_match_with_ar"] == "1/1"
    assert sum(cell["tree"]["accept_hist"]) > 0 == sum(cell["tree"]["accept_hist"][5:])  # at most its depth, 4
    assert cell["tree"]["tau_mean"] > 1 and doc["draft_trees"] == {"tree": "0000.1"}
    assert "tree: rounds verify the draft tree 0000.1" in markdown_table(doc)
    out = str(tmp_path / "e.json")
    for tree, err in (
        ("nope=0000", "one of the --drafter names"),
        ("d=00a", "rank digits"),
        ("d=" + "0" * 16, "block size"),
    ):
        assert main(["eval", "--drafter", "d=builtin", "--draft-tree", tree, "--limit", "1", "--out", out]) == 2
        assert err in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


def test_a_drafters_own_seed_sets_its_initialisation_and_nothing_else():
    from conftest import tiny_target

    from dspine.train.run import DrafterSpec, build_drafters

    t = tiny_target("llama")
    specs = {"a": DrafterSpec(), "b": DrafterSpec(seed=1), "c": DrafterSpec(seed=0), "d": DrafterSpec(seed=1)}
    ds = build_drafters(t, specs, 1, 8, 0, torch.float32, "cpu")
    w = {n: torch.cat([p.flatten() for p in d.parameters()]) for n, d in ds.items()}
    assert torch.equal(w["a"], w["c"]) and torch.equal(w["b"], w["d"])  # None is the run's seed (0 here)
    assert not torch.equal(w["a"], w["b"])
    assert all(d.config == ds["a"].config for d in ds.values())
