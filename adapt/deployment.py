"""Deploying an adapted drafter that passed the gate (`adapt/deploy.py`): swap it into a running `dspine serve`
without dropping requests, check live acceptance, roll back when it falls short, and keep the history.

Design choices:
- **Gate first**: the evaluation document's decision for the group is final; a refused drafter never reaches
  the server (the decision is still recorded).
- **The swap is the server's** (POST /v1/dspine/drafter with the admin key): the checkpoint is loaded and
  checked against the target before anything changes — a wrong or broken file is refused and the old
  drafter keeps serving — and batches already decoding finish on the old drafter.
- **Live check**: a drafter whose weights were swapped wrongly serves τ = 1.0 while its training loss looked
  fine, so every deploy ends with a few greedy requests through the server, their acceptance read back from
  the server's own records; below `live_tolerance` × the gated figure (the adapted drafter's general-benchmark
  τ, else its lowest held-out cell) the previous drafter is swapped back.
- **Routes**: a drafter adapted to one workload (group "tool", or "tool-high" per thinking level) is swapped in
  for that workload's requests only (the server's route "tool" / "tool/high"; the proxy passes the workload on),
  and its live check sends requests of that workload; the group "all" replaces the default drafter.
- **Restart** (`restart`, a backend whose draft model is fixed at launch — SGLang): the command that starts it,
  with {drafter} (the adapted checkpoint, or its `export=sglang` conversion) and {port}; deploy stops the
  backend it started last (`state`: pid and command), starts the new one detached, waits for /v1/models, checks
  live τ (SGLang's per-reply counts, or the dspine server's records) against the previous drafter's live τ on
  the same backend and prompts, measured just before the stop (the gated engine figure when nothing ran), and when
  the start fails or τ falls short, stops it and starts the previous command again. The whole server takes the
  group's drafter: one server per workload behind the proxy's --route. Requests reaching it during the restart
  get the proxy's 503.
- **History**: one JSON line per decision (refused, deployed, rolled back) with its figures, in a file
  rewritten atomically, which the dashboard can show.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dspine.agents.base import LEVELS
from dspine.stats import AcceptanceStats


class DeployError(RuntimeError):
    """The server refused the swap or could not be reached."""


@dataclass
class DeployConfig:
    evaluation: str = ""  # adapt.json of adapt/evaluate.py
    group: str = ""  # which adapted drafter (default: the only one)
    endpoint: str = "http://127.0.0.1:8000"  # the dspine server (not the proxy)
    admin_key: str = ""
    read_key: str = ""  # the server's read key (dspine serve --read-key), for its records; empty: the admin key
    history: str = ""  # JSON lines (default: beside the evaluation, deploys.jsonl)
    prompts: list[str] = field(default_factory=list)  # live-check prompts (default: the general benchmarks')
    live_requests: int = 4
    max_tokens: int = 48
    live_tolerance: float = 0.8  # roll back below this share of the gated τ
    route: str = "auto"  # the server route: "auto" (from the group: all -> default, tool -> tool, tool-high ->
    # tool/high), "default", or a route (WORKLOAD or WORKLOAD/LEVEL)
    restart: str = ""  # the backend's start command, with {drafter} and {port}: deploy by restarting it
    export: str = ""  # "sglang": {drafter} is the adapted checkpoint exported for SGLang (`dspine export`)
    state: str = ""  # the restarted backend's pid and command (default: backend.json beside the history)
    target: str = ""  # the target spec, for exporting a drafter saved without its code table (export=sglang)
    ready_timeout_s: float = 900.0

    @property
    def reader_key(self) -> str:
        """What the server's records and drafter info are read with: the read key, else the admin key."""
        return self.read_key or self.admin_key

    def validate(self) -> None:
        from dspine.config import ConfigError

        if self.export not in ("", "sglang"):
            raise ConfigError(f"export {self.export!r}: empty or sglang")
        if self.export and not self.restart:
            raise ConfigError("export is for a restarted backend: give restart (its start command) too")
        if self.restart and "{drafter}" not in self.restart:
            raise ConfigError("restart must name the drafter it starts with: {drafter}")


def route_of(group: str, route: str = "auto") -> str | None:
    """The server route a group's drafter is deployed to (None: the default drafter)."""
    if route != "auto":
        return None if route == "default" else route
    if group == "all":
        return None
    workload, _, level = group.rpartition("-")
    return f"{workload}/{level}" if workload and level in LEVELS else group


def call_json(url: str, body: dict | None = None, key: str | None = None, timeout: float = 600) -> dict:
    req = urllib.request.Request(
        url, data=None if body is None else json.dumps(body).encode(), method="POST" if body is not None else "GET"
    )
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        msg = e.read().decode(errors="replace")
        try:
            msg = json.loads(msg)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise DeployError(f"{url}: HTTP {e.code}: {msg}") from None
    except OSError as e:
        raise DeployError(f"{url}: {e}") from None


def live_tau(cfg: DeployConfig, prompts: list[str], route: str | None = None) -> dict:
    """Greedy chat requests through the server (as `route`'s workload and level), their acceptance from its
    records -> pooled τ, requests, the drafters that decoded them. A server without dspine's records (SGLang):
    greedy chat requests, τ from the counts each reply carries (`meta_info`)."""
    base = cfg.endpoint.rstrip("/")
    key = cfg.reader_key
    try:
        call_json(base + "/v1/dspine/drafter", key=key, timeout=30)
    except DeployError as e:
        if "HTTP 401" in str(e) or "HTTP 403" in str(e):  # dspine serve, whose records are behind a key
            raise DeployError(f"{e} (give deploy the server's read_key or admin_key)") from None
        return _live_tau_sglang(cfg, prompts)
    model = call_json(base + "/v1/models")["data"][0]["id"]
    pooled, drafters = None, set()
    for p in prompts[: cfg.live_requests]:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": p}],
            "max_tokens": cfg.max_tokens,
            "temperature": 0,
        }
        if route is not None:
            workload, _, level = route.partition("/")
            body["metadata"] = {"workload": workload}
            if level:
                body["reasoning_effort"] = level
        rid = call_json(base + "/v1/chat/completions", body)["id"]
        rec = call_json(f"{base}/v1/dspine/requests/{rid}", key=key)
        drafters.add(rec.get("drafter"))
        hist = rec.get("accept_hist") or []
        if hist:
            st = AcceptanceStats(len(hist), hist)
            pooled = st if pooled is None else pooled.merge(st)
    return {
        "tau": pooled.tau if pooled else 1.0,
        "rounds": pooled.rounds if pooled else 0,
        "requests": min(len(prompts), cfg.live_requests),
        "drafters": sorted(map(str, drafters)),
    }


def _live_tau_sglang(cfg: DeployConfig, prompts: list[str]) -> dict:
    """Greedy chat requests (the chat template applied, as real traffic is) to a server without dspine's records:
    τ from the counts of each reply's `meta_info` (SGLang 0.5.17: per choice, with `return_meta_info`)."""
    from dspine.stats import tau_of

    base = cfg.endpoint.rstrip("/")
    model = call_json(base + "/v1/models")["data"][0]["id"]
    accepted = rounds = 0
    for p in prompts[: cfg.live_requests]:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": p}],
            "max_tokens": cfg.max_tokens,
            "temperature": 0,
            "return_meta_info": True,
        }
        reply = call_json(base + "/v1/chat/completions", body)
        meta = (reply.get("choices") or [{}])[0].get("meta_info") or reply.get("meta_info") or {}
        accepted += meta.get("spec_num_correct_drafts", 0)
        rounds += meta.get("spec_verify_ct", 0)
    return {
        "tau": tau_of(accepted, rounds) if rounds else 1.0,
        "rounds": rounds,
        "requests": min(len(prompts), cfg.live_requests),
        "drafters": ["server"],
    }


# --- restarting a backend -------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def stop_backend(state: dict, timeout: float = 60, child: bool = False) -> None:
    """Stop a backend deploy started (its whole process group: SGLang's scheduler and detokenizer too) — only if
    its PID is still that process (start time and command line as saved) and leads its group: a saved state that
    outlived its process never signals whatever took the number since. `child`: the PID is this process's own
    unreaped child (a number nothing else can have taken), stopped without the check."""
    from dspine.process import same_process

    pid = state["pid"]
    try:
        leader = os.getpgid(pid) == pid
    except OSError:
        return  # gone
    if not leader or not (child or same_process(pid, state.get("identity"))):
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
        try:
            os.killpg(pid, sig)
        except OSError:
            return
        t0 = time.time()
        while time.time() - t0 < wait:
            try:  # reap it when it is our child (a deploy that started it in this process)
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
            if not _alive(pid):
                return
            time.sleep(0.2)


def start_backend(cfg: DeployConfig, command: str, state_path: Path, drafter: str) -> dict:
    """Start `command` detached (its own session, log beside the state; the config's keys in its environment),
    record it, wait until /v1/models answers -> the state; a process that exits or stays silent past
    ready_timeout_s is stopped (DeployError)."""
    from dspine.io import atomic_write_text
    from dspine.process import process_identity, wait_http

    log = state_path.with_name(state_path.stem + ".log")
    with open(log, "ab") as out:
        keys = {"DSPINE_READ_KEY": cfg.read_key, "DSPINE_ADMIN_KEY": cfg.admin_key}
        env = {**os.environ, **{k: v for k, v in keys.items() if v}}  # never in the command
        proc = subprocess.Popen(
            shlex.split(command), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    state = {"pid": proc.pid, "command": command, "drafter": drafter, "started": time.time(), "log": str(log)}
    atomic_write_text(state_path, json.dumps(state))
    try:
        wait_http(cfg.endpoint.rstrip("/") + "/v1/models", proc, cfg.ready_timeout_s)
    except RuntimeError as e:
        stop_backend(state, child=True)  # its whole group: wait_http stops only the leader
        raise DeployError(f"the backend did not come up ({e}); see {log}") from None
    state["identity"] = process_identity(proc.pid)  # once up (past any exec): what stop_backend checks
    atomic_write_text(state_path, json.dumps(state))
    return state


def _restart(cfg: DeployConfig, doc: dict, group: str, entry: dict, gated: float, history: Path) -> dict:
    """Deploy by restart: stop what runs, start the adapted drafter, live check; on failure the previous again."""
    state_path = Path(cfg.state) if cfg.state else history.with_name("backend.json")
    prev = json.loads(state_path.read_text()) if state_path.is_file() else None
    drafter = doc["drafters"][group]["path"]
    if cfg.export == "sglang":
        from dspine.sglang.export import export_sglang

        out = Path(drafter).with_name(Path(drafter).name + "-sglang")
        export_sglang(drafter, out, target=cfg.target or None)
        drafter = str(out)
    port = urllib.parse.urlsplit(cfg.endpoint).port or 80
    command = cfg.restart.format(drafter=drafter, port=port)
    prompts = cfg.prompts or _default_prompts(doc)
    baseline = None
    if prev is not None:
        # the bar: the serving drafter's own live τ on the same backend and prompts, measured just before (an
        # engine figure does not transfer: SGLang's bf16 serving accepts less than the engine's replay)
        try:
            baseline = live_tau(cfg, prompts)
        except DeployError:
            baseline = None
        stop_backend(prev)
    bar = baseline["tau"] if baseline and baseline["rounds"] else gated
    entry["baseline"] = baseline
    entry.update(previous=prev and {k: prev[k] for k in ("command", "drafter")}, command=command)
    try:
        new = start_backend(cfg, command, state_path, drafter)
        live = live_tau(cfg, prompts)
    except DeployError as e:
        new, live, reason = None, None, f"restart failed: {e}"
    else:
        reason = (
            None
            if live["tau"] >= cfg.live_tolerance * bar
            else (f"live τ {live['tau']:.3f} < {cfg.live_tolerance} × {bar:.3f}")
        )
    entry.update(live=live, threshold=cfg.live_tolerance * bar)
    if reason is None:
        entry["action"] = "deployed"
        return entry
    if new is not None:
        stop_backend(new, child=True)
    if prev is not None:
        start_backend(cfg, prev["command"], state_path, prev["drafter"])
    elif state_path.is_file():
        state_path.unlink()
    entry.update(action="rolled_back", reasons=[reason])
    return entry


def _default_prompts(doc: dict) -> list[str]:
    from dspine.workloads import load_benchmark

    benches = (doc.get("general") or {}).get("benchmarks") or ["gsm8k", "mt_bench", "humaneval", "arena_hard"]
    return [it.turns[0] for b in benches for it in load_benchmark(b, 1)]


def _append(path: Path, entry: dict) -> None:
    from dspine.io import atomic_write_text

    old = path.read_text() if path.is_file() else ""
    atomic_write_text(path, old + json.dumps(entry) + "\n")


def deploy(cfg: DeployConfig) -> dict:
    """Gate, swap, live check, roll back if needed -> the history entry (also appended to the history)."""
    doc = json.loads(Path(cfg.evaluation).read_text())
    groups = list(doc["gate"])
    group = cfg.group or (groups[0] if len(groups) == 1 else "")
    if group not in doc["gate"]:
        raise DeployError(f"--group must name one of the evaluated drafters {groups}")
    info, decision = doc["drafters"][group], doc["gate"][group]
    history = Path(cfg.history) if cfg.history else Path(cfg.evaluation).with_name("deploys.jsonl")
    cells = {c: doc["per_cell"][c] for c in info["cells"]}
    gated = (doc.get("general") or {}).get("tau_mean", {}).get(group) or min(c["adapted"] for c in cells.values())
    route = route_of(group, cfg.route)
    entry = {
        "ts": time.time(),
        "group": group,
        "route": route,
        "drafter": info["path"],
        "endpoint": cfg.endpoint,
        "cells": {c: {k: v[k] for k in ("base", "adapted", "ratio")} for c, v in cells.items()},
        "general_regression": (doc.get("general") or {}).get("regression", {}).get(group),
        "gated_tau": gated,
    }
    if not decision["accept"]:
        entry.update(action="refused", reasons=decision["reasons"])
        _append(history, entry)
        return entry
    if cfg.restart:
        entry["route"] = None  # the restarted server serves this drafter for all its traffic
        entry = _restart(cfg, doc, group, entry, gated, history)
        _append(history, entry)
        return entry
    url = cfg.endpoint.rstrip("/") + "/v1/dspine/drafter"
    served = call_json(url, key=cfg.reader_key)
    before = (served.get("routes") or {}).get(route) if route else served
    before = {k: before[k] for k in ("drafter", "path", "method")} if before else None
    body = {"drafter": info["path"], "name": f"adapted/{group}", **({"route": route} if route else {})}
    swap = call_json(url, body, cfg.admin_key)
    live = live_tau(cfg, cfg.prompts or _default_prompts(doc), route)
    entry.update(previous=before, swap=swap["current"], live=live, threshold=cfg.live_tolerance * gated)
    if live["tau"] < cfg.live_tolerance * gated:
        if before is None:  # the route did not exist: its workload goes back to the default drafter
            call_json(url, {"route": route, "remove": True}, cfg.admin_key)
        else:
            back = {"drafter": before.get("path") or "none", "name": before.get("drafter")}
            call_json(url, {**back, **({"route": route} if route else {})}, cfg.admin_key)
        entry.update(action="rolled_back", reasons=[f"live τ {live['tau']:.3f} < {cfg.live_tolerance} × {gated:.3f}"])
    else:
        entry["action"] = "deployed"
    _append(history, entry)
    return entry
