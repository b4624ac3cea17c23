"""The agent harnesses without a model: the jail each harness's tools run in, the swe task set, and the success
checks of the tool and office workloads (reachable: the gold actions, run through the jailed tool path, pass)."""

import json
import socket
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from dspine.agents.base import AgentConfig, Episode
from dspine.agents.office import OfficeHarness
from dspine.agents.sandbox import Jail, JailLimits
from dspine.agents.swe import SweHarness, _adapters
from dspine.agents.tau import TauHarness
from dspine.agents.toolrun import parse

LIMITS = JailLimits(wall_s=6, cpu_s=3, memory_mb=1024, max_procs=32)

HOSTILE = textwrap.dedent(
    """
    import os, socket

    def write_outside(path):
        with open(path, "w") as f:
            f.write("escaped")
        return "wrote"

    def connect(port):
        socket.create_connection(("127.0.0.1", port), timeout=2).sendall(b"hello")
        return "connected"

    def fork_bomb():
        while True:
            os.fork()  # every child forks on too, until the jail's process limit refuses

    def spin():
        while True:
            pass
    """
)


@pytest.fixture
def listener():
    """A real TCP server on 127.0.0.1 that counts connections (a jailed tool must never reach it)."""
    srv = socket.create_server(("127.0.0.1", 0))
    hits = []

    def accept():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            hits.append(conn.recv(16))
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1], hits
    srv.close()


@pytest.fixture
def hostile_module(tmp_path, monkeypatch):
    d = tmp_path / "hostile_pkg"
    d.mkdir()
    (d / "hostile.py").write_text(HOSTILE)
    monkeypatch.setenv("PYTHONPATH", str(d) + (":" + sys.path[0] if sys.path[0] else ""))
    return {
        "evil_write": "hostile:write_outside",
        "evil_connect": "hostile:connect",
        "evil_fork": "hostile:fork_bomb",
        "evil_spin": "hostile:spin",
    }


def episode(h, task, tmp_path, name):
    ep = Episode(AgentConfig(tool_limits=LIMITS), task, "low", f"test-{name}", tmp_path / name, {})
    h.setup(ep)
    return ep


def assert_contained(ep, outside, hits, results):
    assert not outside.exists(), "a jailed tool wrote outside its episode directory"
    assert hits == [], "a jailed tool reached a server on 127.0.0.1"
    res = ep.result(None, "test")  # the episode ends cleanly, with the refusals on record
    assert res.tool_errors >= len(results) and len(res.jail_events) >= 3, res.jail_events
    return res


def test_swe_tools_are_jailed(tmp_path, listener):
    port, hits = listener
    h = SweHarness()
    ep = episode(h, h.tasks()[0], tmp_path, "swe")
    _, JailedEnvironment = _adapters()
    env = JailedEnvironment(ep)
    outside = tmp_path / "outside.txt"
    results = [
        env.execute({"command": f"echo escaped > {outside}"}),
        env.execute({"command": f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}))\""}),
        env.execute({"command": ":(){ :|:& };:"}),
        env.execute({"command": "python3 -c 'while True: pass'"}),
    ]
    assert all(r["returncode"] != 0 for r in results), results
    assert "Permission denied" in results[0]["output"] and "Permission denied" in results[1]["output"]
    inside = env.execute({"command": "echo fine > note.txt && cat note.txt && ls"})
    assert inside["returncode"] == 0 and "fine" in inside["output"] and "ISSUE.md" in inside["output"]
    assert_contained(ep, outside, hits, results)


@pytest.mark.parametrize("harness", ["tool", "office"])
def test_python_tools_are_jailed(tmp_path, listener, hostile_module, harness):
    port, hits = listener
    h = TauHarness(domains=("retail",)) if harness == "tool" else OfficeHarness()
    if harness == "tool":
        h.extra.update(hostile_module)
    else:
        h.tools.update(hostile_module)
    ep = episode(h, h.tasks()[0], tmp_path, harness)
    outside = tmp_path / "outside.txt"
    results = [
        h.execute(ep, "evil_write", json.dumps({"path": str(outside)})),
        h.execute(ep, "evil_connect", json.dumps({"port": port})),
        h.execute(ep, "evil_fork", "{}"),
        h.execute(ep, "evil_spin", "{}"),
        h.execute(ep, "no_such_tool" if harness == "office" else "get_order_details", "{not json"),
    ]
    assert all(r.startswith("Error") for r in results), results
    assert "Permission denied" in results[0] and "Permission denied" in results[1]
    assert "did not finish" in results[3]  # killed by its CPU limit: the jail's report is the result
    if harness == "office":  # the real tools are jailed too: a path outside the episode is refused
        out = h.execute(ep, "write_text", json.dumps({"path": str(outside), "text": "x"}))
        assert "Permission denied" in out
    assert_contained(ep, outside, hits, results)


def test_jail_limits_output_and_time(tmp_path):
    j = Jail(tmp_path / "j", JailLimits(wall_s=2, cpu_s=60, max_output=1000))
    r = j.run_shell("yes | head -c 100000")
    assert r.truncated_chars > 90000 and len(r.output) < 1200
    r = j.run_shell("sleep 30")
    assert r.timed_out and not r.ok and r.seconds < 10
    assert parse("noise\n@@dspine-tool-result@@ " + json.dumps({"ok": True, "result": {"a": 1}})) == (
        True,
        '{"a": 1}\n[printed]\nnoise',
    )
    assert parse("", -9) == (
        False,
        "Error: the tool did not finish (killed by signal 9 (a CPU, memory or time limit)): ",
    )


def test_swe_tasks_fail_before_their_fix_and_pass_after(tmp_path):
    h = SweHarness()
    tasks = h.tasks()
    assert len(tasks) >= 20
    for t in tasks:
        ep = episode(h, t, tmp_path, t.id)
        assert not (ep.workdir / "task.json").exists()  # the fix never enters the episode
        assert h.score(ep) is False, t.id
        for fix in json.loads((Path(t.data["dir"]) / "task.json").read_text())["fix"]:
            p = ep.workdir / fix["file"]
            p.write_text(p.read_text().replace(fix["old"], fix["new"]))
        assert h.score(ep) is True, t.id


def test_tool_success_check_passes_on_the_gold_actions(tmp_path):
    h = TauHarness(domains=("retail",))
    task = next(t for t in h.tasks() if t.id == "retail-0")
    ep = episode(h, task, tmp_path, "gold")
    assert h.score(ep) is False  # nothing done yet
    for a in task.data["actions"]:
        out = h.execute(ep, a["name"], json.dumps(a["arguments"]))
        assert not out.startswith("Error"), out
    assert h.score(ep) is True
    assert sum(h.score(episode(h, t, tmp_path, f"n{i}")) is None for i, t in enumerate(h.tasks()[:20])) < 20


def test_office_success_check_and_skips(tmp_path):
    h = OfficeHarness()
    tasks = h.tasks()
    skipped = h.skipped()
    assert len(tasks) + len(skipped) == 300 and len(skipped) > 0
    assert all("pdf" not in json.dumps(t.data).lower() for t in tasks)
    task = next(t for t in tasks if t.id == "1-1/0")  # "Add a meeting to Bob's calendar at 5/17/2024 10:30..."
    ep = episode(h, task, tmp_path, "office")
    assert h.score(ep) is False
    args = {"username": "Bob", "summary": "Meeting", "start": "2024-05-17 10:30", "end": "2024-05-17 11:00"}
    assert "added" in h.execute(ep, "calendar_add_event", json.dumps(args))
    assert h.score(ep) is True
    assert ep.result(True, "finished").tool_calls == 1  # the harness's own check is not counted as a tool call
