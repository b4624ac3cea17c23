"""Replaying real agent conversations (agents.replay, `adapt/collect.py --source replay`): every import format read
from the shipped files, the cuts made on the server's own rendering, the job against the real `dspine serve` (rows
whose prompt ids are the target's rendering of the exact prefix and whose completion ids decode to the reply), an
idempotent re-run, bad input refused before work; and the evaluation discipline: a three-way split that never
shares a task, cells with too few rows refused by the gate, intervals over tasks."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspine.adapt.evaluation import EvalConfig, cell_figures, gate
from dspine.adapt.finetuning import split_rows
from dspine.agents.replay import ReplayError, plan_turns, read_all, read_conversations, reference, shipped
from dspine.stats import AcceptanceStats

ROOT = Path(__file__).resolve().parents[1]
DATA = shipped()


def test_every_format_reads_to_openai_conversations():
    tau = read_conversations(DATA / "tau_bench_airline_gpt4o" / "gpt-4o-airline.tasks-00-29.json.gz")
    assert len(tau) == 120 and {c.workload for c in tau} == {"tool_replay"}
    assert len({c.task_id for c in tau}) == 30 and len({c.id for c in tau}) == 120  # 4 trials per task
    names = {t["function"]["name"] for t in tau[0].tools}  # the project's airline tools (the source has none)
    assert {"book_reservation", "get_reservation_details"} <= names
    calls = [m for c in tau for m in c.messages if m.get("tool_calls")]
    assert calls and all(isinstance(tc["function"]["arguments"], str) for m in calls for tc in m["tool_calls"])
    assert all(m["tool_call_id"] for c in tau for m in c.messages if m["role"] == "tool")
    oh = read_conversations(DATA / "swe_adp_samples" / "swe-gym_openhands_sampled_trajectories.sample_raw.json.gz")
    assert len(oh) == 5 and all(c.tools for c in oh) and oh[0].task_id == "python__mypy-15976"  # suffix _0 dropped
    smith = read_conversations(DATA / "swe_adp_samples" / "swe-smith.sample_raw.json.gz")
    assert smith[0].task_id == "arrow-py__arrow.1d70d009.lm_rewrite__nuzjfyur" and not smith[0].tools
    neb = read_conversations(DATA / "swe_adp_samples" / "nebius_SWE-agent-trajectories.sample_raw.json.gz")
    assert neb[0].messages[0]["role"] == "system" and neb[0].messages[0]["content"].startswith("SETTING")
    assert {m["role"] for m in neb[0].messages} <= {"system", "user", "assistant"}  # "ai" is the assistant
    traj = read_conversations(DATA / "swe_agent_demonstrations" / "marshmallow-1867.function_calling.traj.gz")
    assert traj[0].task_id == "marshmallow-1867" and any(m.get("tool_calls") for m in traj[0].messages)
    every = read_all([str(DATA)])
    assert {c.workload for c in every} == {"tool_replay", "swe_replay"} and len(every) == 145
    for c in every:  # a turn to replay always has a user message before it
        assert c.assistant_turns() and all(c.messages[i]["role"] == "assistant" for i in c.assistant_turns())


def _generic(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GENERIC = {
    "id": "log-1",
    "task_id": "refund-42",
    "workload": "support",
    "messages": [
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": "I want a refund for order 42."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_order", "arguments": {"order_id": "42"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"status": "delivered", "total": 18.5}'},
        {"role": "assistant", "content": "Your order 42 was delivered; I can refund 18.50 to your card."},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_order",
                "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
            },
        }
    ],
}


def test_bad_conversations_are_refused_with_their_reason(tmp_path):
    g = read_conversations(_generic(tmp_path / "logs.jsonl", [GENERIC]))
    assert g[0].workload == "support" and g[0].task_id == "refund-42" and g[0].assistant_turns() == [2, 4]
    assert json.loads(g[0].messages[2]["tool_calls"][0]["function"]["arguments"]) == {"order_id": "42"}
    with pytest.raises(ReplayError, match="unknown conversation format 'xml'"):
        read_conversations(tmp_path / "logs.jsonl", "xml")
    bare = {**GENERIC, "messages": GENERIC["messages"][:2]}
    with pytest.raises(ReplayError, match="no assistant turn"):
        read_conversations(_generic(tmp_path / "bare.jsonl", [bare]))
    with pytest.raises(ReplayError, match="missing field 'traj'"):
        read_conversations(tmp_path / "logs.jsonl", "tau")
    (tmp_path / "odd.json").write_text(json.dumps([{"turns": []}]))
    with pytest.raises(ReplayError, match="unknown conversation format"):
        read_conversations(tmp_path / "odd.json")
    with pytest.raises(ReplayError, match="workload"):
        read_conversations(_generic(tmp_path / "w.jsonl", [{**GENERIC, "workload": "a b/c"}]))


def test_cuts_are_made_from_the_left_on_the_servers_rendering(smollm2):
    from dspine.agents.replay import Renderer

    r = Renderer("smollm2-135m-instruct")
    conv = read_conversations(DATA / "tau_bench_airline_gpt4o" / "gpt-4o-airline.tasks-00-29.json.gz")[0]
    whole = plan_turns(conv, r, "none", 10**6)
    assert all(cut == 0 for _, cut, _ in whole.turns) and len(whole.turns) == len(conv.assistant_turns())
    budget = whole.turns[-1][2] - 200  # the last turn no longer fits whole
    plan = plan_turns(conv, r, "none", budget)
    i, cut, n = plan.turns[-1]
    assert cut > 0 and n <= budget and not plan.oversize
    sent = conv.messages[:1] + conv.messages[1 + cut : i]
    assert sent[0]["role"] == "system" and sent[1]["role"] != "tool"  # the system message kept, no orphan result
    assert n == len(r.ids(sent, conv.tools, "none"))
    fewer = max(k for k in range(cut) if conv.messages[1 + k]["role"] != "tool")  # the next smaller cut allowed
    longer = conv.messages[:1] + conv.messages[1 + fewer : i]
    assert len(r.ids(longer, conv.tools, "none")) > budget  # the fewest messages were cut: one cut fewer is too long
    tiny = plan_turns(conv, r, "none", 50)  # even the system prompt alone is longer
    assert not tiny.turns and tiny.oversize == conv.assistant_turns()


def test_three_parts_never_share_a_task():
    rows = [
        {"workload": w, "task_id": f"t{t}", "thinking": lv, "episode_id": f"{w}{t}{lv}{k}"}
        for w in ("tool_replay", "swe_replay")
        for t in range(10)
        for lv in ("low", "high")
        for k in range(2)
    ]
    train, val, test = split_rows(rows, 0.2, 0.2, seed=0)
    assert len(train) + len(val) + len(test) == len(rows)
    tasks = [{(r["workload"], r["task_id"]) for r in part} for part in (train, val, test)]
    assert not tasks[0] & tasks[1] and not tasks[0] & tasks[2] and not tasks[1] & tasks[2]
    assert len(tasks[2]) == len(tasks[1]) == 4  # 2 of 10 tasks of each workload, every level of them
    assert {r["thinking"] for r in test} == {"low", "high"}
    assert split_rows(rows, 0.2, 0.2, seed=0) == (train, val, test) != split_rows(rows, 0.2, 0.2, seed=1)
    few = [r for r in rows if r["task_id"] in ("t0", "t1") and r["workload"] == "swe_replay"]
    tr, va, te = split_rows(few, 0.2, 0.2, seed=0)  # two tasks: one trains, one is tested, none validates
    assert tr and te and not va


def test_cells_with_too_few_rows_are_refused_with_intervals_over_tasks():
    def row(task, base, adapted):
        return task, AcceptanceStats(4, base), AcceptanceStats(4, adapted), 10

    cfg = EvalConfig(min_rows=6, min_tasks=3, draws=400)
    rows = [row(f"t{k % 3}", [3, 1, 0, 0], [1, 1, 1, 1 + 2 * (k % 3)]) for k in range(6)]
    cell = cell_figures(rows, cfg)
    assert (cell["rows"], cell["tasks"], cell["tokens"], cell["too_few"]) == (6, 3, 60, False)
    assert cell["ratio"] == pytest.approx(cell["adapted"] / cell["base"]) and cell["ratio"] > 1.5
    lo, hi = cell["ratio_ci"]
    assert lo <= cell["ratio"] <= hi and lo < hi  # the tasks differ: a real interval
    small = cell_figures(rows[:4], cfg)
    assert small["too_few"] and small["ratio"] > 1.5
    doc = {"per_cell": {"a/low": cell, "b/low": small}, "drafters": {"all": {"cells": ["a/low", "b/low"]}}}
    verdict = gate(doc)["all"]
    assert not verdict["accept"] and verdict["reasons"] == ["b/low: too few (4 rows, 3 tasks)"]
    nothing = gate({"per_cell": {}, "drafters": {"x": {"cells": []}}})["x"]  # a split that left no test rows
    assert nothing == {"accept": False, "reasons": ["no test rows: the split left none to judge on"]}
    doc["per_cell"]["b/low"] = {**small, "too_few": False}
    assert gate(doc)["all"]["accept"]
    doc["general"] = {"regression": {"all": 0.01}, "regression_ci": {"all": [-0.01, 0.04]}}
    assert gate(doc, max_general_regression_upper=0.03)["all"]["reasons"] == [
        "general regression's interval reaches 4.0% > 3%"
    ]


def collect(args):
    return subprocess.run(
        [sys.executable, str(ROOT / "adapt" / "collect.py"), "--source", "replay", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "RAY_ADDRESS": ""},
    )


def test_replay_job_rows_are_the_servers_rendering_of_the_exact_prefix(endpoint, smollm2, tmp_path):
    from dspine.agents.replay import Renderer
    from dspine.agents.traces import load_traces

    with gzip.open(DATA / "tau_bench_airline_gpt4o" / "gpt-4o-airline.tasks-00-29.json.gz") as f:
        tau = json.loads(f.read())
    short = [{**t, "traj": t["traj"][:8]} for t in tau[:2]]  # two conversations, their first turns
    (tmp_path / "tau.json").write_text(json.dumps(short))
    _generic(tmp_path / "logs.jsonl", [GENERIC])
    out = tmp_path / "rows"
    args = [
        "--conversations",
        f"{tmp_path / 'tau.json'},{tmp_path / 'logs.jsonl'}",
        "--endpoint",
        endpoint,
        "--levels",
        "none",
        "--max-tokens",
        "8",
        "--max-context",
        "2900",
        "--executor",
        "local",
        "--concurrency",
        "2",
        "--out",
        str(out),
    ]
    r = collect(args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    acc = json.loads((out / "accounts.json").read_text())
    assert (acc["requested"], acc["ok"], acc["failed"]) == (3, 3, 0)
    rows = load_traces(str(out)).to_pylist()
    from dspine.agents.base import episode_id

    convs = {
        episode_id(c.workload, c.id, "none", 0): c
        for c in read_all([str(tmp_path / "tau.json"), str(tmp_path / "logs.jsonl")])
    }
    renderer = Renderer("smollm2-135m-instruct")
    assert len(rows) == acc["replay"]["turns_planned"] and {r["source"] for r in rows} == {"replay"}
    cut_seen = False
    for row in rows:
        conv = convs[row["episode_id"]]
        assert row["task_id"] == conv.task_id and json.loads(row["reference"]) == json.loads(
            reference(conv.messages[row["turn"]])
        )
        msgs = conv.messages[: row["turn"]]
        sent = msgs[:1] + msgs[1 + row["cut"] :]
        assert row["prompt_token_ids"] == renderer.ids(sent, conv.tools, "none")
        assert len(row["prompt_token_ids"]) <= 2900 - 8
        cut_seen |= row["cut"] > 0
        text = smollm2.decode(row["completion_token_ids"])
        if not json.loads(row["tool_calls"]):
            assert text == row["completion_text"]
        assert row["has_token_ids"] and row["accept_hist"] and row["tau"] >= 1.0
    assert cut_seen  # the airline policy leaves little room at 2900 tokens: later turns were cut
    assert {r["task_id"] for r in rows} == {conv.task_id for conv in convs.values()}
    shards = sorted(p.name for p in (out / "traces").rglob("*.parquet"))
    again = collect(args)  # the same command: everything is there
    assert again.returncode == 0 and json.loads((out / "accounts.json").read_text())["skipped"] == 3
    assert sorted(p.name for p in (out / "traces").rglob("*.parquet")) == shards
    # bad input, refused before anything runs
    bad = collect([*args[:-1], str(tmp_path / "other"), "--max-context", "200"])
    assert bad.returncode == 2 and "do not fit" in bad.stderr and not any((tmp_path / "other").rglob("*.json"))
    bad = collect([*args[:-1], "/proc/dspine-nope"])
    assert bad.returncode == 2 and "cannot write the output directory" in bad.stderr
    bad = collect([*args[:-1], str(tmp_path / "x"), "--format", "nebius"])
    assert bad.returncode == 2 and "missing field" in bad.stderr
    # `dspine traces import`: a user's logs in the generic format, the same rows
    cli = [sys.executable, "-m", "dspine.cli", "traces", "import", "--endpoint", endpoint, "--max-tokens", "8"]
    r = subprocess.run(
        [*cli, "--conversations", str(tmp_path / "logs.jsonl"), "--out", str(tmp_path / "imp")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    imported = load_traces(str(tmp_path / "imp")).to_pylist()
    assert sorted(x["turn"] for x in imported) == [2, 4] and {x["workload"] for x in imported} == {"support"}
    mine = sorted((x["turn"], x["prompt_token_ids"]) for x in rows if x["workload"] == "support")
    assert sorted((x["turn"], x["prompt_token_ids"]) for x in imported) == mine
    r = subprocess.run(
        [*cli, "--conversations", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "imp2")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "no such file" in r.stderr
