"""Deploying a drafter into the real `dspine serve` (SmolLM2, 127.0.0.1): the swap endpoint under concurrent
requests (none dropped, every reply equal to AR's), refusals before the swap (no key, another target's drafter,
a corrupted file) with the old drafter serving on, and adapt/deploy.py's gate, live check and roll-back."""

import dataclasses
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import CHAT_PROMPTS, tiny_target

from dspine.adapt.deployment import DeployConfig, DeployError, deploy
from dspine.checkpoint import save_drafter
from dspine.drafter import DSpineDraftModel
from dspine.serve.server import start_server_process

KEY = "sekret"


def call(base, path, body=None, key=None):
    """A POST with `key`, or a GET (the records and drafter reads need a key: the admin key by default)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
    key = KEY if key is None and body is None else key
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(base, prompt):
    body = {"model": "smol", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    status, j = call(base, "/v1/chat/completions", body)
    assert status == 200, j
    return j["choices"][0]["message"]["content"], call(base, f"/v1/dspine/requests/{j['id']}")[1]["drafter"]


@pytest.fixture(scope="module")
def server(smollm2_drafters, tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy")
    a = save_drafter(smollm2_drafters["dspine"][1], root / "a" / "dspine")
    save_drafter(smollm2_drafters["dflash"][1], root / "b" / "dflash")
    tiny = tiny_target("llama")
    save_drafter(DSpineDraftModel.for_target(tiny, method="dspine", num_hidden_layers=1), root / "other" / "dspine")
    shutil.copytree(a, root / "broken")
    wfile = root / "broken" / "model.safetensors"
    wfile.write_bytes(wfile.read_bytes()[:1000])
    extra = ["--admin-key", KEY, "--max-prompt-tokens", "200", "--route", f"review={root / 'b' / 'dflash'}"]
    proc, base = start_server_process(str(a), "smol", extra=extra)
    try:
        yield base, root
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_swap_under_load_drops_nothing_and_refuses_bad_checkpoints(server):
    base, root = server
    assert call(base, "/v1/dspine/drafter")[1]["drafter"] == "a/dspine"
    prompts = CHAT_PROMPTS[:4]
    before, after = [None] * 4, [None] * 4

    def send(out, i):
        out[i] = chat(base, prompts[i])

    threads = [threading.Thread(target=send, args=(before, i)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in range(600):  # the swap comes while they decode
        h = call(base, "/health")[1]
        if h["admitted"] == 4 and h["decoding"]:
            break
        time.sleep(0.05)
    status, swap = call(base, "/v1/dspine/drafter", {"drafter": str(root / "b" / "dflash")}, KEY)
    assert status == 200 and swap["previous"]["drafter"] == "a/dspine" and swap["current"]["method"] == "dflash"
    threads += [threading.Thread(target=send, args=(after, i)) for i in range(4)]
    for t in threads[4:]:
        t.start()
    for t in threads:
        t.join(300)
    assert all(before) and all(after)  # none dropped
    # each record names the drafter that decoded it: the batch running at the swap finished on the old one
    assert "a/dspine" in {d for _, d in before} <= {"a/dspine", "b/dflash"} and {d for _, d in after} == {"b/dflash"}
    # refused before the swap; the current drafter serves on
    assert call(base, "/v1/dspine/drafter", {"drafter": str(root / "a" / "dspine")})[0] == 401
    assert call(base, "/v1/dspine/drafter", {"drafter": str(root / "a" / "dspine")}, "wrong")[0] == 401
    status, e = call(base, "/v1/dspine/drafter", {"drafter": str(root / "other" / "dspine")}, KEY)
    assert status == 400 and "drafter refused" in e["error"]["message"] and "built for" in e["error"]["message"]
    status, e = call(base, "/v1/dspine/drafter", {"drafter": str(root / "broken")}, KEY)
    assert status == 400 and "unreadable safetensors" in e["error"]["message"]
    status, e = call(base, "/v1/dspine/drafter", {"nope": 1}, KEY)
    assert status == 400 and e["error"]["param"] == "nope"
    status, e = call(base, "/v1/dspine/drafter", {"name": "x"}, KEY)
    assert status == 400 and e["error"]["param"] == "drafter"
    assert call(base, "/v1/dspine/drafter")[1]["drafter"] == "b/dflash"
    # AR through the same server: every reply above equals it
    assert call(base, "/v1/dspine/drafter", {"drafter": "none"}, KEY)[1]["current"]["method"] == "ar"
    ar = [chat(base, p) for p in prompts]
    assert [t for t, _ in before] == [t for t, _ in ar] == [t for t, _ in after]
    assert {d for _, d in ar} == {None}
    # 'builtin', as `dspine serve --drafter builtin` takes it: the drafter shipped for the served target
    from dspine.drafters import builtin_drafter

    status, swap = call(base, "/v1/dspine/drafter", {"drafter": "builtin"}, KEY)
    assert status == 200 and Path(swap["current"]["path"]).resolve() == builtin_drafter("smollm2-135m-instruct")
    # another folder whose last two parts are a/dspine: a label of its own, and the records say which one decoded
    twin = shutil.copytree(root / "a" / "dspine", root / "x" / "a" / "dspine")
    status, swap = call(base, "/v1/dspine/drafter", {"drafter": str(twin)}, KEY)
    assert status == 200 and swap["current"]["drafter"].startswith("a/dspine@"), swap
    assert chat(base, prompts[0])[1] == swap["current"]["drafter"]
    assert call(base, "/v1/dspine/drafter", {"drafter": str(root / "a" / "dspine")}, KEY)[1]["current"]["drafter"] == (
        "a/dspine"
    )


def test_deploy_gates_checks_live_acceptance_and_rolls_back(server, tmp_path):
    base, root = server
    call(base, "/v1/dspine/drafter", {"drafter": str(root / "b" / "dflash"), "name": "b/dflash"}, KEY)
    doc = {
        "gate": {"all": {"accept": True, "reasons": []}},
        "drafters": {"all": {"path": str(root / "a" / "dspine"), "cells": ["tool/low"]}},
        "per_cell": {"tool/low": {"base": 1.2, "adapted": 1.5, "ratio": 1.25}},
        "general": None,
    }
    ev = tmp_path / "adapt.json"
    ev.write_text(json.dumps(doc))
    cfg = DeployConfig(
        evaluation=str(ev),
        endpoint=base,
        admin_key=KEY,
        prompts=CHAT_PROMPTS[:2],
        live_requests=2,
        max_tokens=24,
        live_tolerance=0.5,
    )
    ok = deploy(cfg)
    assert ok["action"] == "deployed" and ok["live"]["drafters"] == ["adapted/all"] and ok["live"]["tau"] >= 1.0
    assert ok["route"] is None and call(base, "/v1/dspine/drafter")[1]["drafter"] == "adapted/all"
    # a live τ below the gated figure: swapped back to what served before
    call(base, "/v1/dspine/drafter", {"drafter": str(root / "b" / "dflash"), "name": "b/dflash"}, KEY)
    cfg.live_tolerance = 100.0
    back = deploy(cfg)
    assert back["action"] == "rolled_back" and "live τ" in back["reasons"][0]
    assert back["live"]["drafters"] == ["adapted/all"]  # measured on the new drafter
    now = call(base, "/v1/dspine/drafter")[1]
    assert now["drafter"] == "b/dflash" and now["path"] == str(root / "b" / "dflash")  # the previous one again
    # refused by the gate: the server is not touched
    doc["gate"]["all"] = {"accept": False, "reasons": ["tool/low: τ ratio 0.900 < 1.0"]}
    ev.write_text(json.dumps(doc))
    swaps = len(call(base, "/v1/dspine/drafter")[1]["swaps"])
    assert deploy(cfg)["action"] == "refused"
    assert len(call(base, "/v1/dspine/drafter")[1]["swaps"]) == swaps
    hist = [json.loads(x) for x in (tmp_path / "deploys.jsonl").read_text().splitlines()]
    assert [h["action"] for h in hist] == ["deployed", "rolled_back", "refused"]
    doc["gate"]["all"] = {"accept": True, "reasons": []}
    ev.write_text(json.dumps(doc))
    with pytest.raises(DeployError, match="HTTP 401"):  # a wrong admin key: nothing swapped, nothing recorded
        deploy(DeployConfig(evaluation=str(ev), endpoint=base, admin_key="wrong", prompts=CHAT_PROMPTS[:1]))
    assert len((tmp_path / "deploys.jsonl").read_text().splitlines()) == 3


def test_routes_send_each_workload_to_its_own_drafter(server, tmp_path):
    """Several drafters beside one target: a route per workload (and level), requests of both kinds decoding at
    once (each equal to AR's), adapt/deploy.py deploying a workload's group to its route, roll-backs that restore
    the route or remove it, and bad swap bodies refused by name."""
    from dspine.cli import main

    base, root = server
    url = "/v1/dspine/drafter"
    assert call(base, url)[1]["routes"] == {
        "review": {"drafter": "b/dflash", "path": str(root / "b" / "dflash"), "method": "dflash"}
    }  # dspine serve --route, at start
    assert call(base, url, {"route": "review", "remove": True}, KEY)[1]["previous"]["drafter"] == "b/dflash"
    for bad in ("tool", "to ol=none", "tool/loud=none"):  # refused before anything loads
        assert main(["serve", "--route", bad]) == 2
    call(base, url, {"drafter": str(root / "a" / "dspine"), "name": "a/dspine"}, KEY)
    status, r = call(base, url, {"drafter": str(root / "b" / "dflash"), "name": "b/tool", "route": "tool"}, KEY)
    assert status == 200 and r["route"] == "tool" and r["previous"] is None and r["current"]["method"] == "dflash"
    assert call(base, url, {"drafter": "none", "route": "tool/high"}, KEY)[1]["current"]["method"] == "ar"
    for body, param in (
        ({"drafter": "none", "route": "tool/loud"}, "route"),
        ({"drafter": "none", "route": "a b"}, "route"),
        ({"route": "tool", "remove": "yes"}, "remove"),
        ({"remove": True}, "remove"),
        ({"drafter": "none", "colour": 1}, "colour"),
    ):
        status, e = call(base, url, body, KEY)
        assert status == 400 and e["error"]["param"] == param, (body, e)
    assert set(call(base, url)[1]["routes"]) == {"tool", "tool/high"}

    def ask(prompt, workload=None, effort=None):
        body = {"model": "smol", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
        body.update({"metadata": {"workload": workload}} if workload else {})
        body.update({"reasoning_effort": effort} if effort else {})
        _, j = call(base, "/v1/chat/completions", body)
        return j["choices"][0]["message"]["content"], call(base, f"/v1/dspine/requests/{j['id']}")[1]["drafter"]

    kinds = [(None, None), ("tool", None), ("tool", "high"), ("swe", None)]
    jobs = [(p, w, e) for p in CHAT_PROMPTS[:2] for w, e in kinds]
    got = [None] * len(jobs)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, ask(*jobs[i]))) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    by = {(p, w, e): g for (p, w, e), g in zip(jobs, got)}
    for p in CHAT_PROMPTS[:2]:
        assert [by[p, w, e][1] for w, e in kinds] == ["a/dspine", "b/tool", None, "a/dspine"]
        assert by[p, None, None][0] == by[p, "tool", None][0] == by[p, "swe", None][0]  # all equal AR's (lossless)
    call(base, url, {"drafter": "none"}, KEY)  # AR everywhere else: the default replies are AR's own
    assert [ask(p)[0] for p in CHAT_PROMPTS[:2]] == [by[p, None, None][0] for p in CHAT_PROMPTS[:2]]
    call(base, url, {"drafter": str(root / "a" / "dspine"), "name": "a/dspine"}, KEY)

    doc = {
        "gate": {g: {"accept": True, "reasons": []} for g in ("tool", "swe-high")},
        "drafters": {
            "tool": {"path": str(root / "a" / "dspine"), "cells": ["tool/none"]},
            "swe-high": {"path": str(root / "a" / "dspine"), "cells": ["swe/high"]},
        },
        "per_cell": {
            "tool/none": {"base": 1.2, "adapted": 1.5, "ratio": 1.25},
            "swe/high": {"base": 1.2, "adapted": 1.5, "ratio": 1.25},
        },
        "general": None,
    }
    ev = tmp_path / "adapt.json"
    ev.write_text(json.dumps(doc))
    cfg = DeployConfig(
        evaluation=str(ev),
        group="tool",
        endpoint=base,
        admin_key=KEY,
        prompts=CHAT_PROMPTS[:2],
        live_requests=2,
        max_tokens=16,
        live_tolerance=0.5,
    )
    ok = deploy(cfg)
    assert ok["action"] == "deployed" and ok["route"] == "tool" and ok["live"]["drafters"] == ["adapted/tool"]
    now = call(base, url)[1]
    assert now["drafter"] == "a/dspine" and now["routes"]["tool"]["drafter"] == "adapted/tool"
    call(base, url, {"drafter": str(root / "b" / "dflash"), "name": "b/tool", "route": "tool"}, KEY)
    cfg.live_tolerance = 100.0  # rolled back: the route serves what it served before
    assert deploy(cfg)["action"] == "rolled_back" and call(base, url)[1]["routes"]["tool"]["drafter"] == "b/tool"
    back = deploy(dataclasses.replace(cfg, group="swe-high"))  # a new route, rolled back: removed again
    assert back["route"] == "swe/high" and back["action"] == "rolled_back" and back["previous"] is None
    assert back["live"]["drafters"] == ["adapted/swe-high"] and "swe/high" not in call(base, url)[1]["routes"]
    for route in ("tool", "tool/high"):
        assert call(base, url, {"route": route, "remove": True}, KEY)[1]["current"] is None
    assert call(base, url)[1]["routes"] == {}


def test_one_loop_iteration_from_store_to_deployed_drafter(server, tmp_path):
    """adapt/cycle.py: recorded traffic (token ids) -> traces -> fine-tune -> held-out replay + gate -> deploy;
    a second pass without new traffic is skipped."""
    from dspine.adapt.cycle import LoopConfig, run_loop
    from dspine.adapt.deployment import DeployConfig
    from dspine.adapt.evaluation import EvalConfig
    from dspine.adapt.finetuning import FinetuneConfig
    from dspine.serve.records import RequestRecord
    from dspine.serve.store import AcceptanceStore
    from dspine.train.loop import TrainConfig

    base, root = server
    store = AcceptanceStore(tmp_path / "proxy.db")
    fields = set(RequestRecord.__dataclass_fields__)
    for e, prompt in enumerate(CHAT_PROMPTS[:3]):
        messages = [{"role": "user", "content": prompt}]
        for _turn in range(2):
            body = {"model": "smol", "messages": messages, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
            _, j = call(base, "/v1/chat/completions", body)
            rec = call(base, f"/v1/dspine/requests/{j['id']}")[1]
            r = RequestRecord(**{k: v for k, v in rec.items() if k in fields})
            r.workload, r.thinking = "tool", "low"
            assert r.prompt_token_ids and r.completion_token_ids
            store.append(
                r,
                {
                    "episode_id": f"ep{e}",
                    "task_id": "t",
                    "messages": messages,
                    "tools": [],
                    "tool_calls": [],
                    "sampling": {"temperature": 0},
                },
            )
            messages = [
                *messages,
                {"role": "assistant", "content": j["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Tell me more."},
            ]
    cfg = LoopConfig(
        store=str(tmp_path / "proxy.db"),
        work=str(tmp_path / "loop"),
        every_s=0.01,
        iterations=2,
        min_rows=4,
        finetune=FinetuneConfig(
            base=str(root / "a" / "dspine"),
            workers=0,
            heldout_fraction=0.34,
            validation_fraction=0.0,
            split="episode",  # proxy traffic of a few episodes: too few tasks to split by task
            train=TrainConfig(steps=4, batch_size=2, anchors_per_seq=8, max_len=256, eval_every=100),
        ),
        evaluate=EvalConfig(limit=0, min_ratio=0.0, min_rows=1, min_tasks=1),
        deploy=DeployConfig(
            endpoint=base, admin_key=KEY, prompts=CHAT_PROMPTS[3:5], live_requests=2, max_tokens=16, live_tolerance=0.1
        ),
    )
    first, second = run_loop(cfg, progress=False)
    assert first["action"] == "adapted" and first["rows"] == {"tool": 6} and "tool/low" in first["per_cell"]
    assert [d["action"] for d in first["deploys"]] == ["deployed"]
    assert call(base, "/v1/dspine/drafter")[1]["drafter"] == "adapted/all"
    assert second["action"] == "skipped" and "0 new trace rows" in second["reason"]
    log = json.loads((tmp_path / "loop" / "loop.json").read_text())
    assert [x["action"] for x in log] == ["adapted", "skipped"]
    assert (tmp_path / "loop" / "iter-000" / "adapt.md").is_file()


def test_restart_deploy_starts_the_adapted_backend_and_falls_back(server, tmp_path):
    """A backend whose drafter is fixed at launch (SGLang's way) deployed to by restart — here the real dspine
    server started from the `restart` command: the adapted drafter comes up and is checked live; a drafter
    that cannot start, or whose live τ falls short, is stopped and the previous command started again."""
    import sys

    from dspine.adapt.deployment import stop_backend
    from dspine.config import ConfigError
    from dspine.process import free_port

    _, root = server
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = f"{sys.executable} -m dspine.cli serve --drafter {{drafter}} --served-model-name smol --port {{port}}"
    ev = tmp_path / "adapt.json"

    def run(drafter, tolerance=0.5):
        ev.write_text(
            json.dumps(
                {
                    "gate": {"all": {"accept": True, "reasons": []}},
                    "general": None,
                    "drafters": {"all": {"path": str(drafter), "cells": ["tool/low"]}},
                    "per_cell": {"tool/low": {"base": 1.2, "adapted": 1.5, "ratio": 1.25}},
                }
            )
        )
        return deploy(
            DeployConfig(
                evaluation=str(ev),
                endpoint=endpoint,
                prompts=CHAT_PROMPTS[:2],
                live_requests=2,
                max_tokens=24,
                live_tolerance=tolerance,
                restart=command,
                read_key=KEY,  # the restarted backend gets it in its environment, never in the command
            )
        )

    def serving():
        state = json.loads((tmp_path / "backend.json").read_text())
        return call(endpoint, "/v1/dspine/drafter")[1]["path"], state

    try:
        first = run(root / "a" / "dspine")
        assert first["action"] == "deployed" and first["previous"] is None and first["live"]["tau"] >= 1.0
        path, state = serving()
        assert path == str(root / "a" / "dspine") and str(port) in state["command"]
        broken = run(root / "broken")  # exits at start: the previous command comes back
        assert broken["action"] == "rolled_back" and "restart failed" in broken["reasons"][0]
        path, again = serving()
        assert path == str(root / "a" / "dspine") and again["pid"] != state["pid"]
        short = run(root / "b" / "dflash", tolerance=100.0)  # up, but its live τ falls short
        assert short["action"] == "rolled_back" and "live τ" in short["reasons"][0] and short["live"]["rounds"] > 0
        # the bar is the previous drafter's live τ on this backend, measured just before the restart
        assert short["baseline"]["rounds"] > 0 and short["threshold"] == pytest.approx(100.0 * short["baseline"]["tau"])
        assert serving()[0] == str(root / "a" / "dspine")
        hist = [json.loads(x)["action"] for x in (tmp_path / "deploys.jsonl").read_text().splitlines()]
        assert hist == ["deployed", "rolled_back", "rolled_back"]
    finally:
        if (tmp_path / "backend.json").is_file():
            stop_backend(json.loads((tmp_path / "backend.json").read_text()))
    for bad, msg in (
        (dict(export="sglang"), "give restart"),
        (dict(restart="serve --port {port}"), "{drafter}"),
        (dict(restart=command, export="vllm"), "export"),
    ):
        with pytest.raises(ConfigError, match=msg):
            DeployConfig(**bad).validate()


def test_a_saved_backend_pid_is_signalled_only_while_it_is_that_process():
    """deploy stops a backend it started from a saved state (backend.json) only if the PID is still that process
    — the same start time and command line — and leads its own group; a PID taken since, a state without an
    identity, or a process in someone else's group are left alone."""
    import subprocess
    import sys

    from dspine.adapt.deployment import stop_backend
    from dspine.process import process_identity

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    own = subprocess.Popen(sleeper, start_new_session=True)
    shared = subprocess.Popen(sleeper)  # in this process's group: killpg there would hit the caller too
    try:
        ident = process_identity(own.pid)
        assert ident["cmdline"] == sleeper and ident["start_ticks"] > 0
        for saved in (
            {"pid": own.pid, "identity": {**ident, "start_ticks": ident["start_ticks"] - 1}},  # reused since
            {"pid": own.pid, "identity": {**ident, "cmdline": ["sglang"]}},
            {"pid": own.pid},  # saved before identities were recorded
            {"pid": shared.pid, "identity": process_identity(shared.pid)},
        ):
            stop_backend(saved, timeout=2)
            time.sleep(0.3)
            assert own.poll() is None and shared.poll() is None, saved
        stop_backend({"pid": own.pid, "identity": ident}, timeout=10)
        assert own.wait(timeout=10) is not None and process_identity(own.pid) is None
    finally:
        for p in (own, shared):
            p.kill()
            p.wait()


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """Two asks in a row may get one port from the kernel (a Ray head's GCS and dashboard then collide): free_port
    asks again rather than give a port it gave before."""
    import socket

    from dspine import process

    kernel = iter([41001, 41001, 41001, 41002])

    class Fake:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, addr):
            self.port = next(kernel)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(process, "_GIVEN", set())
    monkeypatch.setattr(socket, "socket", Fake)
    assert [process.free_port(), process.free_port()] == [41001, 41002]
