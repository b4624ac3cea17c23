"""`ray job submit ... adapt/collect.py` against a real local Ray head and the real `dspine serve` (SmolLM2 with a
small DSpine drafter): every workload × two thinking levels, traces loadable with `datasets` and carrying every
field, token ids that decode to what the server returned; a re-run that skips what is done; a Ray worker killed
by its pid mid-episode, after which every episode is there exactly once; and bad input refused before any work."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dspine.adapt.cluster import LocalRayHead, alive
from dspine.agents.traces import SCHEMA

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--max-turns", "2", "--max-tokens", "16", "--concurrency", "2", "--tool-wall-s", "20"]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A head of the test's own (its temp dir, its ports), stopped by its own processes' ids."""
    with LocalRayHead(num_cpus=2) as head:
        yield head.dashboard, head.env


def test_stopping_one_ray_head_leaves_another_running(ray_head):
    """The project's cleanup ends its own head's processes and nothing else: a second head started beside the
    module's takes jobs, and stopping it leaves the module's running (its job API answers, its processes live)."""
    import urllib.request

    url, _ = ray_head
    with urllib.request.urlopen(url + "/api/version", timeout=5) as r:
        assert r.status == 200
    other = LocalRayHead(num_cpus=1)
    theirs = other.pids()
    assert len(theirs) > 2 and other.dashboard != url
    # a second head on the machine takes jobs too (each head's agent listens on a port of its own)
    r = submit((other.dashboard, other.env), ["--help"])
    assert r.returncode == 0, r.stderr[-2000:]
    other.stop()
    assert not any(alive(p) for p in theirs)
    with urllib.request.urlopen(url + "/api/version", timeout=5) as r:  # the first head still serves
        assert r.status == 200
    r = submit(ray_head, ["--help"])
    assert r.returncode == 0, r.stderr[-2000:]


def submit(ray_head, args, wait=True):
    url, env = ray_head
    cmd = ["ray", "job", "submit", "--address", url, "--working-dir", str(ROOT)]
    cmd += ([] if wait else ["--no-wait"]) + ["--", "python", "adapt/collect.py", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)


def direct(args):
    """adapt/collect.py run directly (no Ray): for input that must be refused before anything starts."""
    return subprocess.run(
        [sys.executable, str(ROOT / "adapt" / "collect.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": ""},
    )


def files(out: Path, sub: str) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in (out / sub).rglob("*") if p.is_file())


def test_collect_job_traces_and_rerun(ray_head, endpoint, smollm2, tmp_path):
    import datasets

    out = tmp_path / "traces"
    args = [
        "--endpoint",
        endpoint,
        "--out",
        str(out),
        "--workloads",
        "swe,tool,office",
        "--levels",
        "low,high",
        "--episodes",
        "2",
        *SMALL,
    ]
    r = submit(ray_head, args)
    assert r.returncode == 0 and "succeeded" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    acc = json.loads((out / "accounts.json").read_text())
    assert (acc["requested"], acc["ok"], acc["failed"], acc["skipped"]) == (12, 12, 0, 0), acc
    ds = datasets.load_dataset("parquet", data_files=f"{out}/traces/*/*.parquet", split="train")
    assert set(ds.column_names) == set(SCHEMA.names)
    episodes = {(row["workload"], row["thinking"], row["episode_id"]) for row in ds}
    assert Counter((w, lv) for w, lv, _ in episodes) == {
        (w, lv): 2 for w in ("swe", "tool", "office") for lv in ("low", "high")
    }
    for row in ds:
        assert row["has_token_ids"] and row["prompt_token_ids"] and row["completion_token_ids"]
        assert len(row["completion_token_ids"]) == row["completion_tokens"]
        text = smollm2.decode(row["completion_token_ids"])
        if json.loads(row["tool_calls"]):  # the calls were parsed out of the generated text
            assert all(c["function"]["name"] in text for c in json.loads(row["tool_calls"]))
        else:
            assert text == row["completion_text"]
        last = json.loads(row["messages"])[-1]
        assert (last.get("content") or "")[-40:] in smollm2.decode(row["prompt_token_ids"])
        assert sum(row["accept_hist"]) >= 1 and row["tau"] >= 1.0  # per-call acceptance from the drafter
        assert row["target"] and row["drafter"] and len(row["chat_template_sha256"]) == 64
        assert json.loads(row["sampling"])["reasoning_effort"] == row["thinking"]
        assert row["termination"] and row["latency_s"] > 0
        assert all(t["function"]["name"] for t in json.loads(row["tools"]))
    shards = files(out, "traces")
    r = submit(ray_head, args)  # the same command again: everything is done already
    assert r.returncode == 0, r.stdout[-2000:]
    acc = json.loads((out / "accounts.json").read_text())
    assert (acc["requested"], acc["ok"], acc["skipped"]) == (12, 0, 12) and files(out, "traces") == shards
    assert not (out / "_tmp").exists() or not files(out, "_tmp")
    r = direct([*args[: -len(SMALL)], "--max-turns", "3"])  # same --out, another configuration
    assert r.returncode == 2 and "another configuration" in r.stderr and "max_turns" in r.stderr


def test_killed_worker_episode_is_retried_once(ray_head, endpoint, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient
    from ray.util.state import list_tasks

    url, _ = ray_head
    out = tmp_path / "fault"
    args = [
        "--endpoint",
        endpoint,
        "--out",
        str(out),
        "--workloads",
        "tool",
        "--levels",
        "low",
        "--episodes",
        "2",
        "--retries",
        "2",
        *SMALL,
    ]
    r = submit(ray_head, args, wait=False)
    job = re.search(r"raysubmit_[A-Za-z0-9]+", r.stdout + r.stderr).group(0)
    killed = None
    deadline = time.time() + 300
    while killed is None and time.time() < deadline:
        running = [
            t
            for t in list_tasks(address=url, filters=[("state", "=", "RUNNING")], detail=True)
            if t.name == "run_episode" and t.worker_pid
        ]
        if running:
            time.sleep(3)  # well inside the episode (its first model call is under way)
            killed = running[0].worker_pid
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.5)
    assert killed is not None, "no episode was seen running"
    client = JobSubmissionClient(url)
    while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.time() < deadline + 600
        time.sleep(2)
    logs = client.get_job_logs(job)
    acc = json.loads((out / "accounts.json").read_text())
    assert acc["ok"] + acc["failed"] + acc["skipped"] == acc["requested"] == 2, logs[-3000:]
    assert acc["failed"] == 0, acc["failures"]  # the killed episode ran again
    summaries = [json.loads((out / "episodes" / f).read_text()) for f in os.listdir(out / "episodes")]
    assert len(summaries) == 2 and len({s["episode_id"] for s in summaries}) == 2
    assert killed not in {s["worker_pid"] for s in summaries}
    assert len(files(out, "traces")) == 2 and all(f.endswith(".parquet") for f in files(out, "traces"))


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"--endpoint": "http://127.0.0.1:9/v1"}, "does not answer"),
        ({"--workloads": "swe,chess"}, "unknown workload"),
        ({"--levels": "low,ultra"}, "unknown thinking level"),
        ({"--episodes": "0"}, "--episodes must be a positive integer"),
        ({"--episodes": "-3"}, "--episodes must be a positive integer"),
        ({"--out": "/proc/dspine-cannot-write"}, "cannot write the output directory"),
    ],
)
def test_bad_input_is_refused_before_any_work(endpoint, tmp_path, change, needle):
    args = {"--endpoint": endpoint, "--out": str(tmp_path / "out"), "--episodes": "1", **change}
    r = direct([x for kv in args.items() for x in kv])
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.json"))


def test_plan_runs_in_rounds_over_cells():
    """Episode i of every workload × level cell comes before episode i + 1 of any (a collection stopped early
    holds every cell alike); tasks repeat only past a workload's task count, as the next repetition."""
    from dspine.adapt.collection import CollectConfig, harness, plan

    cfg = CollectConfig(endpoint="unused", out="unused", levels=["low", "high"], episodes=30)
    p = plan(cfg)
    cells = [(s["workload"], s["level"]) for s in p]
    assert len(p) == 30 * 6 and len(set(s["episode_id"] for s in p)) == len(p)
    for r in range(30):
        assert Counter(cells[r * 6 : (r + 1) * 6]) == Counter({c: 1 for c in set(cells)})
    swe = [s for s in p if s["workload"] == "swe" and s["level"] == "low"]
    n = len(harness("swe").tasks())
    assert len({s["task_id"] for s in swe[:n]}) == n and swe[n]["task_id"] == swe[0]["task_id"] and swe[n]["rep"] == 1


def test_local_executor_collects_without_ray(endpoint, tmp_path):
    """--executor local: the same accounts and traces from worker processes of this machine, Ray not started."""
    import pyarrow.parquet as pq

    out = tmp_path / "local"
    args = [
        "--endpoint",
        endpoint,
        "--out",
        str(out),
        "--workloads",
        "tool",
        "--levels",
        "low,high",
        "--episodes",
        "1",
        "--executor",
        "local",
        *SMALL,
    ]
    r = direct(args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    acc = json.loads((out / "accounts.json").read_text())
    assert (acc["requested"], acc["ok"], acc["failed"], acc["skipped"]) == (2, 2, 0, 0), acc
    rows = [row for f in (out / "traces").rglob("*.parquet") for row in pq.read_table(f).to_pylist()]
    assert {row["thinking"] for row in rows} == {"low", "high"} and all(row["completion_token_ids"] for row in rows)
    r = direct(args)  # again: everything done already
    assert r.returncode == 0 and json.loads((out / "accounts.json").read_text())["skipped"] == 2
