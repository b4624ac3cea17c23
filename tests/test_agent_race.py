"""The agent race's hold-out (bench/agent_race.py): the turns measured are of held-out tasks only, and the corpus the
suffix drafter and the hybrid read never holds a measured task — with the fine-tune's test tasks, by default, and
with the target's own completions as the corpus."""

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path

import pytest

from dspine.agents.base import TraceRow
from dspine.agents.traces import Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmark scripts, not the package
from agent_race import held_out, select
from test_finetune import _row


def _saved() -> dict:
    rows, corpus = [], []
    for w, tasks in (("tool_replay", ["a1", "a2", "a3", "a4"]), ("swe_replay", ["s1", "s2"])):
        for t in tasks:
            for conv in range(2):
                rows.append({"workload": w, "task": t, "conversation": f"{t}-{conv}", "turn": 2, "ids": [1, 2]})
            corpus.append({"workload": w, "task": t, "ids": [sum(map(ord, t)), 7]})
    return {"rows": rows, "corpus": corpus}


def _trace(task: str, workload: str, ids: list[int]) -> TraceRow:
    row = _row(f"e-{task}", 2, random.Random(0), workload=workload, level="none")
    return dataclasses.replace(row, task_id=task, completion_token_ids=ids, completion_tokens=len(ids))


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"heldout": None, "corpus_traces": None, "corpus_generate": 0, "tasks": 0, **kw})


def test_the_measured_tasks_never_feed_the_corpus(tmp_path):
    saved = _saved()
    held = held_out(_args(), saved["rows"])
    assert held == {"tool_replay:a2", "tool_replay:a4", "swe_replay:s2"}  # every other task per workload
    rows, pool, what = select(_args(), saved)
    assert {f"{r['workload']}:{r['task']}" for r in rows} == held and len(rows) == 6
    assert sorted(ids[0] for _, ids in pool) == sorted(sum(map(ord, t)) for t in ("a1", "a3", "s1"))
    assert "original" in what
    # the fine-tune's test part decides, capped per workload
    ft = tmp_path / "finetune.json"
    ft.write_text(
        json.dumps({"groups": {"all": {"test_tasks": ["tool_replay:a1", "tool_replay:a3", "swe_replay:s1"]}}})
    )
    rows, pool, _ = select(_args(heldout=str(ft), tasks=1), saved)
    assert {(r["workload"], r["task"]) for r in rows} == {("tool_replay", "a1"), ("swe_replay", "s1")}
    assert all(ids[0] != sum(map(ord, t)) for _, ids in pool for t in ("a1", "a3", "s1"))
    # the target's own completions as the corpus: only those of tasks not held out
    st = Store(str(tmp_path / "col"))
    for t, ids in (("a1", [11, 12]), ("a2", [21, 22]), ("s2", [31, 32])):
        w = "swe_replay" if t.startswith("s") else "tool_replay"
        st.write_rows([_trace(t, w, ids)], "traces", w, f"e-{t}.parquet")
    st.clean_tmp()
    _, pool, what = select(_args(heldout=str(ft), corpus_traces=str(tmp_path / "col")), saved)
    assert sorted(ids for _, ids in pool) == [[21, 22], [31, 32]] and "own completions" in what
    # a fine-tune of other conversations leaves nothing to measure: said, not an empty table
    ft.write_text(json.dumps({"groups": {"all": {"test_tasks": ["tool_replay:zz"]}}}))
    with pytest.raises(SystemExit, match="no turn of a held-out task"):
        select(_args(heldout=str(ft)), saved)


def test_a_generated_corpus_is_the_targets_own_answers_to_turns_of_other_tasks_only(smollm2):
    from agent_race import corpus_prompts, own_completions

    from dspine.engine import Engine
    from dspine.sampling import SamplingParams

    saved = _saved()
    for k, r in enumerate(saved["rows"]):
        r["ids"] = [k, k + 1]
    held = held_out(_args(), saved["rows"])  # a2, a4, s2 measured
    picked = corpus_prompts(saved["rows"], held, 3)
    tasks = {tuple(r["ids"]): (r["workload"], r["task"]) for r in saved["rows"]}
    got = [tasks[tuple(ids)] for _, ids in picked]
    # each task of the other half in turn, at most 3 per workload: a1, a3, a1 (tool); s1, s1 (swe has two)
    assert got == [("swe_replay", "s1")] * 2 + [("tool_replay", "a1"), ("tool_replay", "a3"), ("tool_replay", "a1")]
    assert all(f"{w}:{t}" not in held for w, t in got)
    rows, pool, what = select(_args(corpus_generate=3), saved)
    assert pool == picked and "generated" in what and {f"{r['workload']}:{r['task']}" for r in rows} == held
    with pytest.raises(SystemExit, match="give one"):
        select(_args(corpus_generate=3, corpus_traces="somewhere"), saved)
    # the completions are the target's greedy answers, batched as given
    eng = Engine(smollm2, None)
    prompts = [("tool_replay", eng.prompt_ids("Name three colours.")), ("swe_replay", eng.prompt_ids("Say hi."))]
    out = own_completions(smollm2, prompts, 12, batch=2)
    alone = [eng.generate(ids, SamplingParams(max_tokens=12, temperature=0.0)).token_ids for _, ids in prompts]
    assert [w for w, _ in out] == ["tool_replay", "swe_replay"] and [ids for _, ids in out] == alone


def test_each_hybrid_is_compared_with_its_own_drafter_and_the_corpus_suffix():
    from agent_race import hybrid_pairs, ratio_key

    run = ["ar", "suffix+corpus", "dspine", "hybrid", "hybrid@skip2", "dspine-adapted", "hybrid-adapted@skip2"]
    assert hybrid_pairs(run) == {"hybrid": "dspine", "hybrid@skip2": "dspine", "hybrid-adapted@skip2": "dspine-adapted"}
    assert hybrid_pairs(["ar", "dspine", "hybrid"]) == {}  # no suffix+corpus in the run: nothing to compare with
    assert hybrid_pairs(["ar", "suffix+corpus", "hybrid-adapted"]) == {}  # nor without its drafter alone
    assert ratio_key("hybrid-adapted@skip2") == "hybrid_adapted@skip2_over_best_single"
    # --prefix-variants: a @prefix hybrid is compared with the @prefix drafter and suffix+corpus, against its own AR
    from agent_race import ar_of, suffix_of

    both = ["ar", "suffix+corpus", "dspine", "hybrid"]
    both += [m + "@prefix" for m in both]
    assert hybrid_pairs(both) == {"hybrid": "dspine", "hybrid@prefix": "dspine@prefix"}
    assert (suffix_of("hybrid@prefix"), ar_of("hybrid@prefix"), ar_of("hybrid")) == (
        "suffix+corpus@prefix",
        "ar@prefix",
        "ar",
    )
