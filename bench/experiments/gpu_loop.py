"""The mission's GPU path as one script: Ray collects agent traffic from SGLang through `dspine proxy`, Ray Train
adapts the drafter, the held-out rows are replayed through SGLang and through the engine, the gate decides, and
the deploy restarts SGLang with the adapted drafter behind the proxy (then a broken drafter, deployed on purpose,
is rolled back).

On a GPU box with SGLang 0.5.17 and dspine[proxy,adapt] installed (the dspine plugin registered: `pip install -e .`
does it), one command does it all:

    python bench/experiments/gpu_loop.py all --work /tmp/gpuloop --out bench/results/gpu_loop.json

Stages, each one command (run them in order; a stage reads what the earlier ones left in WORK/state.json, so a
box whose calls are time-limited can run them one by one while the servers stay up):
  up       a Ray head on 127.0.0.1 (its own temp dir and ports), SGLang serving the target with the dspine plugin
           and the base drafter (started as adapt/deploy.py restarts it), `dspine proxy` in front of it
  collect  `ray job submit ... adapt/collect.py` through the proxy: the live harnesses at two thinking levels and
           the replay of the shipped real agent conversations, token ids and acceptance from SGLang
  adapt    `ray job submit ... adapt/finetune.py` (Ray Train, one GPU worker) on the merged collection, split by
           task with a validation part; adapt/evaluate.py replays the test rows through the engine and gates
  replay   the same test rows through SGLang (/generate on the exact prompt ids; τ from its meta_info) beside the
           engine's replay; agreement within --tolerance
  deploy   adapt/deploy.py restarts SGLang with the adapted drafter (exported) while clients keep sending through
           the proxy (a 503 or a refused connection is retried; lost = gave up); the live τ check; the test rows
           through the adapted server; then a drafter with random weights deployed on purpose: rolled back
  report   τ per workload × level from the proxy's store before and after the deploy; JSON + Markdown (--out) and
           the `gpu_loop` section of --summary
  down     stops what `up` started (by the pids it recorded, checked against their start time and command line)
  replicas (on its own, after `up --replicas N`) the replay collection of the same conversations through one
           backend and through all N replicas behind the proxy (one model name, requests spread at random):
           episodes per minute each, the speed-up and the scaling efficiency
  race     (SGLang only, on its own after `adapt`) AR, NGRAM without and with the training tasks' completions as
           its external corpus, the plugin with the base and the adapted drafter, on the test rows at
           --race-concurrency: τ, tokens/s and × AR
`--backend dspine` runs every stage against `dspine serve` instead (any machine, CPU included): a rehearsal of the
orchestration, restarted the same way.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from dspine.io import atomic_write_text, md_table, provenance, update_summary

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("up", "collect", "adapt", "replay", "deploy", "report")  # `all`; `race` runs on its own
# SGLang for the loop: triton attention and torch sampling (no FA3 / flashinfer JIT needed), the radix cache off (the
# plugin's measured path; a reused prefix also changes bf16 numerics between the replays), no CUDA graphs (each
# restart would recapture them), a small KV pool so Ray Train and the engine's evaluation share the GPU with it
# the race measures speed: decode CUDA graphs on (batch 1..32), the KV pool shared with the loop's own server
RACE_FLAGS = (
    "--attention-backend triton --sampling-backend pytorch --disable-radix-cache --mem-fraction-static 0.4 "
    "--max-total-tokens 131072 --max-running-requests 32 --disable-prefill-cuda-graph "
    "--cuda-graph-bs-decode 1 2 4 8 16 32"
)
SGLANG_FLAGS = (
    "--attention-backend triton --sampling-backend pytorch --disable-radix-cache --disable-cuda-graph "
    "--mem-fraction-static 0.3 "
    "--max-total-tokens 131072 --max-running-requests 32"
)


def log(msg: str) -> None:
    print(f"[gpu_loop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Loop:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.work = Path(a.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.state_path = self.work / "state.json"
        self.result_path = self.work / "gpu_loop.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.is_file() else {}
        self.result = json.loads(self.result_path.read_text()) if self.result_path.is_file() else {}

    # --- bookkeeping ------------------------------------------------------------------------------------------
    def save(self) -> None:
        atomic_write_text(self.state_path, json.dumps(self.state, indent=1))
        atomic_write_text(self.result_path, json.dumps(self.result, indent=1))

    def need(self, *keys: str) -> None:
        missing = [k for k in keys if k not in self.state]
        if missing:
            raise SystemExit(f"gpu_loop: run the earlier stages first (state lacks {', '.join(missing)})")

    def env(self) -> dict:
        from dspine.adapt.cluster import ray_env

        env = ray_env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
        return env

    def run(self, cmd: list[str], name: str, timeout: float | None = None) -> int:
        """A child in the foreground, its output in WORK/logs/NAME.log (the last lines echoed) -> its exit code."""
        path = self.work / "logs" / f"{name}.log"
        path.parent.mkdir(exist_ok=True)
        log(f"{name}: {shlex.join(cmd)[:300]}")
        t0 = time.time()
        with open(path, "wb") as out:
            try:
                proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env(), timeout=timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = 124
        tail = path.read_text(errors="replace").splitlines()[-12:]
        log(f"{name}: rc {rc} in {time.time() - t0:.0f} s\n    " + "\n    ".join(tail))
        return rc

    def ray_job(self, args: list[str], name: str, timeout: float | None = None) -> int:
        """`ray job submit` of `python ARGS` to our head, with this checkout as its working dir (--executor
        local: the same script in a plain process, its episodes in local workers and its training in-process)."""
        if self.a.executor == "local":
            extra = ["--executor", "local"] if args[0].endswith("collect.py") else []
            return self.run([sys.executable, str(ROOT / args[0]), *args[1:], *extra], name, timeout)
        self.need("ray")
        rt = json.dumps({"excludes": [".git", ".carry", ".whl", "runs", "*.safetensors", "*.gguf"]})
        cmd = ["ray", "job", "submit", "--address", self.state["ray"]["dashboard"], "--working-dir", str(ROOT)]
        cmd += ["--runtime-env-json", rt, "--", sys.executable, *args]
        return self.run(cmd, name, timeout)

    # --- the backend ------------------------------------------------------------------------------------------
    def backend_command(self) -> str:
        """The start command of the backend, with {drafter} and {port} (adapt/deploy.py's `restart`)."""
        py = shlex.quote(sys.executable)
        if self.a.backend == "sglang":
            return (
                f"{py} -m sglang.launch_server --model-path {shlex.quote(self.state['target_dir'])} --host 127.0.0.1 "
                f"--port {{port}} --served-model-name {self.a.model} --dtype bfloat16 --context-length "
                f"{self.a.context} {SGLANG_FLAGS} --speculative-algorithm DFLASH --speculative-draft-model-path "
                f"{{drafter}} --speculative-num-draft-tokens {self.state['block_size']}"
            )
        return (
            f"{py} -m dspine.cli serve --target {shlex.quote(self.a.target)} --drafter {{drafter}} --port {{port}} "
            f"--served-model-name {self.a.model} --device {self.a.device} --max-prompt-tokens {self.a.context - 256}"
        )

    def ensure_backend(self) -> None:
        """The backend answers, or it is started again from its recorded command on the same port (the proxy's
        route stays valid); each restart is counted in the result with the log's last line."""
        from dspine.adapt.deployment import start_backend

        base = f"http://127.0.0.1:{self.state['backend_port']}"
        try:
            urllib.request.urlopen(base + "/v1/models", timeout=10).read()
            return
        except OSError:
            pass
        rec = _read_json(self.work / "backend.json") or {}
        tail = (self.work / "backend.log").read_text(errors="replace").strip().splitlines()[-1:]
        log(f"the backend does not answer ({tail}); starting it again")
        t0 = time.time()
        start_backend(self.deploy_cfg(ready_timeout_s=self.a.ready_timeout), rec["command"], self.work / "backend.json",
                      rec["drafter"])  # fmt: skip
        self.result.setdefault("backend_restarts", []).append({"log": tail, "seconds": round(time.time() - t0, 1)})
        self.save()

    def replay_args(self, model: str, out: Path, conversations: int, turns: int) -> list[str]:
        """adapt/collect.py's arguments for the replay of the conversations through the proxy as MODEL into OUT
        (at most CONVERSATIONS per workload and TURNS each; 0: all)."""
        args = ["adapt/collect.py", "--source", "replay", "--conversations", self.a.conversations]
        args += ["--endpoint", f"http://127.0.0.1:{self.state['proxy']['port']}/v1", "--model", model]
        args += ["--api-key", self.state["proxy_key"], "--concurrency", str(self.a.concurrency), "--out", str(out)]
        args += ["--levels", "none", "--max-tokens", str(self.a.replay_tokens), "--skip-oversize"]
        args += ["--max-context", str(self.window()), "--tokenizer", self.state.get("target_dir", self.a.target)]
        args += ["--max-conversations", str(conversations)] if conversations else []
        return args + (["--max-turns", str(turns)] if turns else [])

    def window(self) -> int:
        """The tokens a replayed prefix plus its reply may take: the backend's context, less SGLang's DFLASH decode
        reserve (2 blocks) — at page size 1 a request that ends within it of the context boundary leaks KV slots
        (sgl-project/sglang#33579), which SGLang's idle check then stops the server for (the likely cause of the
        first GPU loop's exit)."""
        reserve = 2 * int(self.state.get("block_size", 16)) if self.a.backend == "sglang" else 0
        return self.a.context - reserve

    def deploy_cfg(self, port: int | None = None, state: str = "backend.json", **kw):
        from dspine.adapt.deployment import DeployConfig

        return DeployConfig(
            endpoint=f"http://127.0.0.1:{port or self.state['backend_port']}",
            admin_key=self.state["admin_key"],
            read_key=self.state["admin_key"],
            state=str(self.work / state),
            target=self.a.target,
            history=str(self.work / "deploys.jsonl"),
            **kw,
        )

    # --- stages -----------------------------------------------------------------------------------------------
    def up(self) -> None:
        from dspine.adapt.cluster import LocalRayHead
        from dspine.adapt.deployment import start_backend
        from dspine.process import free_port, wait_http
        from dspine.target import resolve_target_path

        t0 = time.time()
        self.state.setdefault("admin_key", secrets.token_hex(16))
        self.state.setdefault("proxy_key", "sk-" + secrets.token_hex(16))
        if "ray" not in self.state and self.a.executor == "ray":
            head = LocalRayHead(num_cpus=self.a.ray_cpus, num_gpus=1 if self.a.device == "cuda" else 0)
            self.state["ray"] = head.record()
            log(f"ray head at {head.address}, jobs at {head.dashboard}")
        drafter = str(Path(self.a.drafter).resolve())
        if self.a.backend == "sglang":
            from dspine.sglang.export import export_sglang

            self.state["target_dir"] = str(resolve_target_path(self.a.target))
            self.state["block_size"] = int(json.loads((Path(drafter) / "config.json").read_text())["block_size"])
            drafter = export_sglang(drafter, self.work / "exports" / "base", target=self.a.target)["path"]
        self.state["base_drafter"] = drafter
        self.save()
        if "backend_port" not in self.state:
            self.state["backend_port"] = free_port()
            cfg = self.deploy_cfg(ready_timeout_s=self.a.ready_timeout)
            cmd = self.backend_command().format(drafter=drafter, port=self.state["backend_port"])
            t1 = time.time()
            start_backend(cfg, cmd, Path(cfg.state), drafter)
            self.result["backend_start_s"] = round(time.time() - t1, 1)
            log(f"{self.a.backend} serves on {self.state['backend_port']} after {time.time() - t1:.0f} s")
            self.save()
        # the replicas beyond the first: the same command on their own ports, each with its own state file (the
        # deploy and the replay stages use the first)
        while len(self.state.setdefault("replica_ports", [])) < self.a.replicas - 1:
            port, k = free_port(), len(self.state["replica_ports"]) + 1
            cfg = self.deploy_cfg(port=port, state=f"replica{k}.json", ready_timeout_s=self.a.ready_timeout)
            t1 = time.time()
            start_backend(cfg, self.backend_command().format(drafter=drafter, port=port), Path(cfg.state), drafter)
            self.state["replica_ports"].append(port)
            log(f"replica {k} serves on {port} after {time.time() - t1:.0f} s")
            self.save()
        if "proxy" not in self.state:
            port = free_port()
            env = {
                **self.env(),
                "DSPINE_PROXY_KEY": self.state["proxy_key"],
                "DSPINE_READ_KEY": self.state["admin_key"],
            }
            ports = [self.state["backend_port"], *self.state["replica_ports"]]
            cmd = [sys.executable, "-m", "dspine.cli", "proxy", "--port", str(port)]
            for b in proxy_backends(self.a.model, ports):
                cmd += ["--backend", b]
            cmd += ["--db", str(self.work / "proxy.db"), "--workdir", str(self.work / "proxy")]
            out = open(self.work / "proxy.log", "ab")
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, 180)
            from dspine.process import process_identity

            self.state["proxy"] = {"port": port, "pid": proc.pid, "identity": process_identity(proc.pid)}
            log(f"proxy on {port}")
        self.result["up_s"] = round(time.time() - t0, 1)
        self.result["backend"] = self.a.backend
        self.save()

    def collect(self) -> None:
        self.need("proxy")
        self.ensure_backend()
        endpoint = f"http://127.0.0.1:{self.state['proxy']['port']}/v1"
        common = ["--endpoint", endpoint, "--api-key", self.state["proxy_key"], "--model", self.a.model]
        common += ["--concurrency", str(self.a.concurrency)]
        runs = {}
        t0 = time.time()
        if self.a.live_episodes:
            out = self.work / "collect-live"
            args = ["adapt/collect.py", *common, "--out", str(out), "--workloads", self.a.live_workloads]
            args += ["--levels", "low,high", "--episodes", str(self.a.live_episodes), "--max-turns", "4"]
            args += ["--max-tokens", str(self.a.live_tokens)]
            t1 = time.time()
            runs["live"] = {"rc": self.ray_job(args, "collect-live"), "seconds": round(time.time() - t1, 1)}
            runs["live"]["accounts"] = _read_json(out / "accounts.json")
        out = self.work / "collect-replay"
        args = self.replay_args(self.a.model, out, self.a.max_conversations, self.a.replay_turns)
        t1 = time.time()
        self.ensure_backend()
        runs["replay"] = {"rc": self.ray_job(args, "collect-replay"), "seconds": round(time.time() - t1, 1)}
        runs["replay"]["accounts"] = _read_json(out / "accounts.json")
        merged = merge_collections([self.work / "collect-live", out], self.work / "traces")
        self.result["collect"] = {"runs": runs, "rows": merged, "seconds": round(time.time() - t0, 1)}
        self.result["collect"].update(trace_figures(self.work / "traces", time.time() - t0))
        self.save()

    def adapt(self) -> None:
        self.need("base_drafter")
        ft = self.work / "finetune"
        args = ["adapt/finetune.py", "--traces", str(self.work / "traces"), "--out", str(ft)]
        workers = "1" if self.a.executor == "ray" else "0"  # 0: in the job's own process, without Ray Train
        args += ["--base", self.a.drafter, "--target", self.a.target, "--workers", workers, "--device", self.a.device]
        recipe = {"train.time_budget_s": self.a.train_s, "train.steps": 100000, "train.batch_size": 8}
        recipe |= {"train.max_len": 2048, "train.anchors_per_seq": 64, "train.eval_every": 50}
        recipe |= {"train.warmup_steps": 20, "per": "all", "mode": "full", "train.lr": 1e-4}
        recipe |= {"blend_choices": "[0.5,0.7,1.0]", "general_validation": 3}  # blends checked on general items
        recipe |= dict(kv.split("=", 1) for kv in self.a.finetune_set)  # --finetune-set replaces a setting
        args += [f"{k}={v}" for k, v in recipe.items()]
        t0 = time.time()
        rc = self.ray_job(args, "finetune")
        doc = _read_json(ft / "finetune.json") or {}
        self.result["finetune"] = {
            "rc": rc,
            "seconds": round(time.time() - t0, 1),
            "workers": 1 if self.a.executor == "ray" else 0,
            "executor": self.a.executor,
            "groups": {
                g: {k: v.get(k) for k in ("train_samples", "validation_samples", "parts", "split", "blend", "last")}
                for g, v in (doc.get("groups") or {}).items()
                if isinstance(v, dict)
            },
        }
        self.save()
        if rc:
            raise SystemExit("gpu_loop: the fine-tune failed (see logs/finetune.log)")
        t0 = time.time()
        ev = [sys.executable, str(ROOT / "adapt" / "evaluate.py"), "--finetune", str(ft)]
        ev += ["--out", str(self.work / "adapt.json")]
        ev += [f"limit={self.a.general_limit}", "batch_size=32", f"general_workers={self.a.general_workers}"]
        ev += self.a.eval_set
        rc = self.run(ev, "evaluate")
        doc = _read_json(self.work / "adapt.json") or {}
        self.result["evaluate"] = {
            "rc": rc,
            "seconds": round(time.time() - t0, 1),
            "per_cell": {
                c: {k: v.get(k) for k in ("base", "adapted", "ratio", "ratio_ci", "rows", "tasks", "tokens", "too_few")}
                for c, v in (doc.get("per_cell") or {}).items()
            },
            "general_regression": doc.get("general_regression"),
            "general_regression_ci": doc.get("general_regression_ci"),
            "gate": doc.get("gate"),
        }
        self.save()

    @functools.cached_property
    def trace_rows(self) -> list[dict]:
        """Every row of the merged collection (read once, after the collection)."""
        from dspine.agents.traces import load_traces

        return load_traces(str(self.work / "traces")).to_pylist()

    @functools.cached_property
    def heldout(self) -> set[str]:
        """The fine-tune's test episodes (held out by task)."""
        doc = json.loads((self.work / "finetune" / "finetune.json").read_text())
        return {e for g in doc["groups"].values() for e in g.get("heldout_episodes", [])}

    @functools.cached_property
    def test_rows(self) -> list[dict]:
        """The fine-tune's test rows with their ids: prompt and completion ids, workload, level."""
        rows = [r for r in self.trace_rows if r["episode_id"] in self.heldout]
        return [r for r in rows if r["prompt_token_ids"] and r["completion_token_ids"]]

    def sglang_replay(self, name: str) -> dict:
        """The test rows' exact prompts through the backend at T = 0, as many tokens as each recorded completion
        -> per cell pooled τ (from the backend's own counts), rows, tokens, exact match with the recorded ids."""
        from dspine.stats import tau_of

        base = f"http://127.0.0.1:{self.state['backend_port']}"
        rows = self.test_rows
        cells: dict[str, dict] = {}

        def one(r: dict) -> tuple[dict, dict]:
            n = len(r["completion_token_ids"])
            if self.a.backend == "sglang":
                body = {"input_ids": r["prompt_token_ids"], "sampling_params": {"max_new_tokens": n, "temperature": 0}}
                doc = _post(base + "/generate", body)
                return r, {"meta": doc["meta_info"], "ids": doc.get("output_ids")}
            body = {
                "model": self.a.model,
                "prompt": r["prompt_token_ids"],
                "max_tokens": n,
                "temperature": 0,
                "return_meta_info": True,
                "return_token_ids": True,
            }
            doc = _post(base + "/v1/completions", body)
            return r, {"meta": doc.get("meta_info") or {}, "ids": doc["choices"][0].get("token_ids")}

        from concurrent.futures import ThreadPoolExecutor

        t0 = time.time()
        with ThreadPoolExecutor(self.a.concurrency) as ex:
            done = list(ex.map(one, rows))
        for r, got in done:
            c = cells.setdefault(f"{r['workload']}/{r['thinking']}", {"acc": 0, "rounds": 0, "rows": 0, "tokens": 0})
            m = got["meta"]
            c["acc"] += int(m.get("spec_num_correct_drafts") or 0)
            c["rounds"] += int(m.get("spec_verify_ct") or 0)
            c["rows"] += 1
            c["tokens"] += int(m.get("completion_tokens") or len(got["ids"] or []))
            c.setdefault("tasks", set()).add(r["task_id"])
            c["match"] = c.get("match", 0) + int(list(got["ids"] or []) == list(r["completion_token_ids"]))
        out = {}
        for k, c in sorted(cells.items()):
            out[k] = {
                "tau": round(tau_of(c["acc"], c["rounds"]), 3) if c["rounds"] else None,
                "rows": c["rows"],
                "tasks": len(c["tasks"]),
                "tokens": c["tokens"],
                "exact_match": round(c["match"] / c["rows"], 3),
            }
        self.result.setdefault("replay", {})[name] = {"cells": out, "seconds": round(time.time() - t0, 1)}
        self.save()
        return out

    def proxy_replay(self, name: str) -> dict:
        """The test rows' recorded messages (tools included) as chat requests through the proxy, each tagged with
        its workload and level: what the proxy's store shows per cell. Their ids are kept for the report."""
        rows = self.test_rows
        url = f"http://127.0.0.1:{self.state['proxy']['port']}/v1/chat/completions"

        def one(r: dict) -> str | None:
            body = {
                "model": self.a.model,
                "messages": json.loads(r["messages"]),
                "max_tokens": len(r["completion_token_ids"]),
                "temperature": 0,
                "metadata": {"workload": r["workload"]},
                "return_meta_info": True,
            }
            tools = json.loads(r["tools"] or "[]")
            if tools:
                body["tools"] = tools
            if r["thinking"] != "none":
                body["reasoning_effort"] = r["thinking"]
            try:
                return _post(url, body, self.state["proxy_key"], timeout=300)["id"]
            except (OSError, ValueError, KeyError) as e:
                log(f"proxy replay {r['request_id']}: {e}")
                return None

        from concurrent.futures import ThreadPoolExecutor

        t0 = time.time()
        with ThreadPoolExecutor(self.a.concurrency) as ex:
            ids = [i for i in ex.map(one, rows) if i]
        self.state.setdefault("store_ids", {})[name] = ids  # the proxy stores each under the backend's id
        self.state.setdefault("replay_started", t0)
        self.result.setdefault("replay", {}).setdefault("through_proxy", {})[name] = {
            "requests": len(rows),
            "ok": len(ids),
            "seconds": round(time.time() - t0, 1),
        }
        self.save()
        return self.result["replay"]["through_proxy"][name]

    def replay(self) -> None:
        self.need("backend_port")
        self.ensure_backend()
        got = self.sglang_replay("base")
        self.proxy_replay("base")
        engine = (self.result.get("evaluate") or {}).get("per_cell") or {}
        agree = {}
        for cell, v in got.items():
            e = (engine.get(cell) or {}).get("base")
            if v["tau"] and e:
                rel = v["tau"] / e - 1
                ok = abs(rel) <= self.a.tolerance
                agree[cell] = {"backend": v["tau"], "engine": e, "rel": round(rel, 3), "ok": ok}
        self.result["replay"]["agreement"] = {"tolerance": self.a.tolerance, "cells": agree}
        self.save()
        log(f"replay through {self.a.backend}: {json.dumps(got)}; agreement {json.dumps(agree)}")

    def deploy(self) -> None:
        from dspine.adapt.deployment import deploy

        self.need("backend_port", "proxy")
        self.ensure_backend()
        restart = self.backend_command()
        export = "sglang" if self.a.backend == "sglang" else ""
        self.state["deploy_started"] = time.time()
        self.save()
        probe = ProxyClients(self.state, self.a.model, self.a.probe_clients)
        probe.start()
        t0 = time.time()
        cfg = self.deploy_cfg(
            evaluation=str(self.work / "adapt.json"), restart=restart, export=export,
            ready_timeout_s=self.a.ready_timeout,
        )  # fmt: skip
        entry = deploy(cfg)
        seconds = time.time() - t0
        time.sleep(3)
        traffic = probe.stop()
        self.state["deployed_at"] = time.time()
        self.result["deploy"] = {
            "action": entry["action"],
            "reasons": entry.get("reasons"),
            "seconds": round(seconds, 1),
            "live": entry.get("live"),
            "threshold": entry.get("threshold"),
            "traffic": traffic,
        }
        self.save()
        log(f"deploy: {entry['action']} in {seconds:.0f} s; live {entry.get('live')}; traffic {traffic}")
        if entry["action"] == "deployed":
            got = self.sglang_replay("adapted")
            self.proxy_replay("adapted")
            base = self.result["replay"].get("base", {}).get("cells", {})
            self.result["replay"]["ratio"] = {
                c: round(v["tau"] / base[c]["tau"], 3)
                for c, v in got.items()
                if v["tau"] and base.get(c, {}).get("tau")
            }
        self.rollback_check(restart, export)

    def rollback_check(self, restart: str, export: str) -> None:
        """A drafter with random weights, passed off as gated, deployed on purpose: the live check must roll it back
        and the previous drafter must serve again."""
        from dspine.adapt.deployment import deploy

        doc = json.loads((self.work / "adapt.json").read_text())
        group = next(iter(doc["gate"]))
        broken = self.work / "broken"
        scramble_drafter(doc["drafters"][group]["path"], broken)
        doc["drafters"][group]["path"] = str(broken)
        doc["gate"][group] = {"accept": True, "reasons": ["deployed on purpose: random weights"]}
        fake = self.work / "adapt_broken.json"
        atomic_write_text(fake, json.dumps(doc))
        t0 = time.time()
        cfg = self.deploy_cfg(
            evaluation=str(fake), restart=restart, export=export, ready_timeout_s=self.a.ready_timeout
        )
        entry = deploy(cfg)
        serving = _read_json(self.work / "backend.json") or {}
        self.result["rollback"] = {
            "action": entry["action"],
            "reasons": entry.get("reasons"),
            "live": entry.get("live"),
            "seconds": round(time.time() - t0, 1),
            "serving_after": serving.get("drafter"),
        }
        self.save()
        log(f"broken drafter: {entry['action']} ({entry.get('reasons')}); serving {serving.get('drafter')}")

    def replicas(self) -> None:
        """The replay collection of the same conversations (--replica-conversations per workload) through one backend
        (the proxy's `MODEL-1`) and through every replica (`MODEL`, requests spread at random), each into a fresh
        folder, --concurrency episodes at once: episodes per minute, the speed-up, the scaling efficiency."""
        self.need("proxy")
        n = 1 + len(self.state.get("replica_ports", []))
        if n < 2:
            raise SystemExit("gpu_loop: the replicas stage needs `up --replicas N` with N >= 2")
        runs = {}
        for k, model in ((1, f"{self.a.model}-1"), (n, self.a.model)):
            out = self.work / f"replicas-{k}"
            shutil.rmtree(out, ignore_errors=True)  # a rerun measures again, not a resumed collection
            args = self.replay_args(model, out, self.a.replica_conversations, self.a.replay_turns or 4)
            t0 = time.time()
            rc = self.ray_job(args, f"replicas-{k}")
            seconds = time.time() - t0
            figures = trace_figures(out, seconds)
            rows = sum(c["rows"] for c in figures["cells"].values())
            runs[str(k)] = {"rc": rc, "seconds": round(seconds, 1), "rows": rows, **figures}
        self.result["replicas"] = replica_scaling(runs, n)
        self.save()
        log(f"replicas: {json.dumps(self.result['replicas'])[:400]}")

    def race(self) -> None:
        """The race in SGLang on the held-out test rows (never the rows the corpus is built from): AR, NGRAM without
        and with the target's completions of the training tasks as its external corpus, the dspine plugin with the
        base and the adapted drafter (and DFlash with --dflash): one server at a time beside the loop's, τ from
        SGLang's counts and tokens/s at each --race-concurrency, × AR. A rerun skips the methods already measured."""
        from dspine.sglang.bench import SGLangServer, _run_set
        from dspine.stats import tau_of

        if self.a.backend != "sglang":
            raise SystemExit("gpu_loop: the race is SGLang's (the CPU engine's race is bench/agent_race.py)")
        self.need("target_dir", "block_size")
        rows = self.test_rows[: self.a.race_rows]
        prompts = [list(r["prompt_token_ids"]) for r in rows]
        conc = [int(c) for c in self.a.race_concurrency.split(",")]
        corpus = self.work / "corpus.jsonl"
        if not corpus.is_file():  # never a test task's: training and validation rows only
            train = [r for r in self.trace_rows if r["episode_id"] not in self.heldout]
            atomic_write_text(corpus, "".join(json.dumps(r["completion_text"]) + "\n" for r in train))
        ngram = ["--speculative-algorithm", "NGRAM"]
        methods = {
            "ar": [],
            "ngram": ngram,
            "ngram+corpus": [*ngram, "--speculative-ngram-external-corpus-path", str(corpus)]
            + ["--speculative-ngram-external-sam-budget", str(self.a.sam_budget)],
        }
        drafters = {"dspine": self.state["base_drafter"]}
        adapted = self.work / "finetune" / "all"
        if adapted.is_dir():
            from dspine.sglang.export import export_sglang

            out = self.work / "exports" / "adapted"
            if not out.is_dir():
                export_sglang(str(adapted), out, target=self.a.target)
            drafters["dspine-adapted"] = str(out)
        if self.a.dflash:
            drafters["dflash"] = self.a.dflash
        for name, path in drafters.items():
            methods[name] = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", path,
                             "--speculative-num-draft-tokens", str(self.state["block_size"])]  # fmt: skip
        flags = shlex.split(RACE_FLAGS) + ["--context-length", str(self.a.context)]
        done = self.result.setdefault("race", {"rows": len(rows), "concurrency": conc, "methods": {}})
        for name, extra in methods.items():
            if name in done["methods"] and "error" not in done["methods"][name]:
                continue
            log(f"race: {name}")
            srv = SGLangServer(self.state["target_dir"], None, 0, [*flags, *extra], "bfloat16",
                               self.work / "logs" / f"race-{name}.log")  # fmt: skip
            entry: dict = {"flags": extra}
            try:
                srv.wait(self.a.ready_timeout)
                entry["startup_s"] = round(srv.startup_s, 1)
                for c in conc:
                    docs, wall = _run_set(srv, prompts, c, self.a.replay_tokens, 0.0)
                    toks = sum(d["meta_info"]["completion_tokens"] for d in docs)
                    acc = sum(d["meta_info"].get("spec_num_correct_drafts", 0) for d in docs)
                    rounds = sum(d["meta_info"].get("spec_verify_ct", 0) for d in docs)
                    entry[str(c)] = {
                        "tokens": toks,
                        "seconds": round(wall, 2),
                        "tokens_per_s": round(toks / wall, 1),
                        "tau": round(tau_of(acc, rounds), 3) if rounds else 1.0,
                    }
            except (RuntimeError, OSError, KeyError) as e:
                entry["error"] = f"{type(e).__name__}: {e}"
            finally:
                srv.close()
            done["methods"][name] = entry
            ar = done["methods"].get("ar", {})
            for m in done["methods"].values():
                for c in conc:
                    if str(c) in m and str(c) in ar:
                        m[str(c)]["vs_ar"] = round(m[str(c)]["tokens_per_s"] / ar[str(c)]["tokens_per_s"], 3)
            self.save()
            log(f"race {name}: {json.dumps(entry)[:400]}")

    def report(self) -> dict:
        from dspine.serve.store import AcceptanceStore

        store = AcceptanceStore(str(self.work / "proxy.db"))
        rows = store.rows()
        ids = {name: set(v) for name, v in self.state.get("store_ids", {}).items()}
        # the held-out test rows sent through the proxy before and after the deploy (the same requests)
        self.result["store"] = {name: store_cells([r for r in rows if r["request_id"] in v]) for name, v in ids.items()}
        # what the proxy recorded before them: the collection's traffic
        cut = self.state.get("replay_started", time.time())
        self.result["store"]["collection"] = store_cells([r for r in rows if r["ts"] < cut])
        self.result.update(provenance())
        self.result["sglang_version"] = _version("sglang")
        self.result["ray_version"] = _version("ray")
        self.result["flags"] = SGLANG_FLAGS if self.a.backend == "sglang" else "dspine serve"
        self.save()
        if self.a.out:
            out = Path(self.a.out)
            atomic_write_text(out, json.dumps(self.result, indent=1))
            atomic_write_text(out.with_suffix(".md"), markdown(self.result))
        if self.a.summary:
            update_summary(self.a.summary, "gpu_loop", summary_section(self.result))
        print(markdown(self.result))
        return self.result

    def down(self) -> None:
        from dspine.adapt.cluster import stop_recorded
        from dspine.adapt.deployment import stop_backend
        from dspine.process import same_process

        for f in [self.work / "backend.json", *sorted(self.work.glob("replica*.json"))]:
            b = _read_json(f)
            if b:
                stop_backend(b)
        p = self.state.get("proxy")
        if p and same_process(p["pid"], p.get("identity")):
            import signal

            for sig in (signal.SIGTERM, signal.SIGTERM):  # the second skips the drain
                try:
                    os.killpg(p["pid"], sig)
                except OSError:
                    break
                time.sleep(2)
        if self.state.get("ray"):
            stop_recorded(self.state["ray"])
        for k in ("ray", "proxy", "backend_port", "replica_ports"):
            self.state.pop(k, None)
        self.save()


class ProxyClients:
    """Clients sending short chat requests through the proxy during a deploy; a 503 (the backend is restarting)
    or a refused connection is retried after a second, up to `tries`; a request that still fails is lost."""

    def __init__(self, state: dict, model: str, n: int, tries: int = 600):
        self.url = f"http://127.0.0.1:{state['proxy']['port']}/v1/chat/completions"
        self.key, self.model, self.n, self.tries = state["proxy_key"], model, n, tries
        self.stopping = threading.Event()
        self.counts = {"sent": 0, "ok": 0, "retried": 0, "lost": 0, "statuses": {}}
        self.lock = threading.Lock()

    def _one(self, i: int) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            "max_tokens": 24,
            "temperature": 0,
            "metadata": {"workload": "deploy_probe"},
        }
        for _ in range(self.tries):
            try:
                _post(self.url, body, self.key, timeout=120)
                with self.lock:
                    self.counts["ok"] += 1
                return
            except urllib.error.HTTPError as e:
                code = str(e.code)
            except OSError as e:
                code = type(e).__name__
            with self.lock:
                self.counts["statuses"][code] = self.counts["statuses"].get(code, 0) + 1
                self.counts["retried"] += 1
            time.sleep(1.0)
        with self.lock:
            self.counts["lost"] += 1

    def _client(self, k: int) -> None:
        i = k * 100000
        while not self.stopping.is_set():
            with self.lock:
                self.counts["sent"] += 1
            self._one(i)
            i += 1

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(self.n)]
        for t in self.threads:
            t.start()

    def stop(self) -> dict:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=900)
        return dict(self.counts)


# --- helpers ----------------------------------------------------------------------------------------------------


def proxy_backends(model: str, ports: list[int]) -> list[str]:
    """`dspine proxy --backend` values: MODEL served by every backend (replicas), and with several, MODEL-1 by the
    first alone (the one-replica side of the replicas stage)."""
    out = [f"{model}=http://127.0.0.1:{p}/v1@{model}" for p in ports]
    if len(ports) > 1:
        out.append(f"{model}-1=http://127.0.0.1:{ports[0]}/v1@{model}")
    return out


def replica_scaling(runs: dict, n: int) -> dict:
    """{"1": figures through one backend, "N": through N} (trace_figures + rc) -> the runs, the speed-up in episodes
    per minute and the scaling efficiency (speed-up / N)."""
    one, all_ = runs["1"].get("episodes_per_min"), runs[str(n)].get("episodes_per_min")
    speedup = all_ / one if one and all_ else None
    return {
        "replicas": n,
        "runs": runs,
        "speedup": round(speedup, 3) if speedup else None,
        "efficiency": round(speedup / n, 3) if speedup else None,
    }


def _post(url: str, body: dict, key: str | None = None, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def merge_collections(dirs: list[Path], out: Path) -> dict[str, int]:
    """Several collection directories -> one (their trace shards and episode summaries side by side; the
    workloads of live and replay collections differ, so no shard is overwritten) -> rows per workload."""
    import pyarrow.parquet as pq

    rows: dict[str, int] = {}
    for d in dirs:
        for sub in ("traces", "episodes"):
            src = d / sub
            if not src.is_dir():
                continue
            for f in sorted(src.rglob("*")):
                if f.is_file():
                    dst = out / sub / f.relative_to(src)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, dst)
                    if sub == "traces" and f.suffix == ".parquet":
                        w = f.parent.name
                        rows[w] = rows.get(w, 0) + pq.read_metadata(f).num_rows
    return rows


def by_cell(rows: list[dict]) -> dict:
    """Rows (trace rows or the store's) -> per workload/level: stats.group_by's figures over their recorded
    acceptance (`items`: all rows; `requests`: those with verify rounds; `tau_pooled`)."""
    from dspine.stats import AcceptanceStats, group_by

    def stats(r: dict):
        h = r["accept_hist"]
        return AcceptanceStats(len(h), list(h)) if h else None

    return group_by((f"{r['workload']}/{r['thinking']}", stats(r)) for r in rows)


def _tau(g: dict) -> float | None:
    return round(g["tau_pooled"], 3) if g["requests"] and g["tau_pooled"] is not None else None


def trace_figures(traces: Path, seconds: float) -> dict:
    """Per workload × level: episodes, rows, rows with token ids, generated tokens, τ pooled from the recorded
    acceptance; episodes per minute over the collection's wall time."""
    from dspine.agents.traces import load_traces

    rows = load_traces(str(traces)).to_pylist() if (traces / "traces").is_dir() else []
    groups, cells = by_cell(rows), {}
    for r in rows:
        cells.setdefault(f"{r['workload']}/{r['thinking']}", []).append(r)
    out = {}
    for k, mine in sorted(cells.items()):
        out[k] = {
            "episodes": len({r["episode_id"] for r in mine}),
            "tasks": len({r["task_id"] for r in mine}),
            "rows": len(mine),
            "rows_with_ids": sum(bool(r["has_token_ids"]) for r in mine),
            "tokens": sum(len(r["completion_token_ids"] or []) for r in mine),
            "tau_recorded": _tau(groups[k]),
        }
    episodes = sum(v["episodes"] for v in out.values())
    return {"cells": out, "episodes": episodes, "episodes_per_min": round(episodes / max(seconds, 1e-9) * 60, 2)}


def store_cells(rows: list[dict]) -> dict:
    """The proxy's recorded requests -> per workload/level: requests, those with acceptance, τ pooled over them."""
    groups = by_cell(rows)
    return {
        k: {"requests": g["items"], "with_acceptance": g["requests"], "tau": _tau(g)} for k, g in sorted(groups.items())
    }


def scramble_drafter(src: str, out: Path, seed: int = 0) -> None:
    """A copy of a drafter folder whose weights are random (same names, shapes and dtypes): it loads, and drafts
    nothing the target accepts."""
    import torch
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    g = torch.Generator().manual_seed(seed)
    for f in out.glob("*.safetensors"):
        sd = load_file(str(f))
        sd = {k: (torch.randn(v.shape, generator=g) * 0.02).to(v.dtype) for k, v in sd.items()}
        save_file(sd, str(f), metadata={"format": "pt"})


def _r(x, nd: int = 3):
    return round(x, nd) if isinstance(x, float) else x


def summary_section(doc: dict) -> dict:
    keep = ("backend", "collect", "finetune", "evaluate", "replay", "deploy", "rollback", "store", "race", "replicas")
    out = {k: doc.get(k) for k in keep if k in doc}
    for k in ("git_sha", "command", "hardware", "sglang_version", "ray_version", "flags"):
        out[k] = doc.get(k)
    return out


def markdown(doc: dict) -> str:
    lines = [f"# The GPU loop ({doc.get('backend')}; {doc.get('hardware', '')})", ""]
    col = doc.get("collect") or {}
    if col:
        lines += [
            f"Collection: {col.get('episodes')} episodes in {col.get('seconds')} s "
            f"({col.get('episodes_per_min')} episodes/min)",
            "",
        ]
        rows = [
            [k, v["episodes"], v["tasks"], v["rows"], v["rows_with_ids"], v["tokens"], v["tau_recorded"]]
            for k, v in col.get("cells", {}).items()
        ]
        lines += [md_table(["cell", "episodes", "tasks", "rows", "rows with ids", "tokens", "τ (served)"], rows), ""]
    ft = doc.get("finetune") or {}
    if ft:
        lines += [f"Fine-tune (Ray Train, {ft.get('workers')} worker): {ft.get('seconds')} s, rc {ft.get('rc')}", ""]
    ev = doc.get("evaluate") or {}
    rp = doc.get("replay") or {}
    if ev:
        agree = (rp.get("agreement") or {}).get("cells", {})
        served = (rp.get("base") or {}).get("cells", {})
        served_ad = (rp.get("adapted") or {}).get("cells", {})
        rows = []
        for c, v in ev.get("per_cell", {}).items():
            rows.append(
                [
                    c,
                    v.get("rows"),
                    v.get("tasks"),
                    _r(v.get("base")),
                    _r(v.get("adapted")),
                    _r(v.get("ratio")),
                    (served.get(c) or {}).get("tau"),
                    (served_ad.get(c) or {}).get("tau"),
                    (agree.get(c) or {}).get("rel"),
                ]
            )
        head = ["cell", "test rows", "tasks", "engine τ base", "engine τ adapted", "ratio", "served τ base"]
        head += ["served τ adapted", "served/engine − 1"]
        lines += [md_table(head, rows), ""]
        ci = [_r(x) for x in ev.get("general_regression_ci") or []]
        lines += [f"General regression {_r(ev.get('general_regression'))} (95% CI {ci}); "]
        lines += [f"gate {json.dumps(ev.get('gate'))}", ""]
    for k in ("deploy", "rollback"):
        if doc.get(k):
            lines += [f"{k}: `{json.dumps(doc[k])}`", ""]
    race = doc.get("race") or {}
    if race.get("methods"):
        conc = race["concurrency"]
        head = ["method", *[f"c={c} tok/s (× AR)" for c in conc], "τ (c=1)"]
        rows = []
        for m, v in race["methods"].items():
            cells = [f"{v[str(c)]['tokens_per_s']} ({v[str(c)].get('vs_ar')})" if str(c) in v else "—" for c in conc]
            rows.append([m, *cells, (v.get(str(conc[0])) or {}).get("tau", v.get("error", "—"))])
        lines += [f"The race in SGLang ({race['rows']} held-out test rows)", "", md_table(head, rows), ""]
    rp = doc.get("replicas") or {}
    if rp:
        n, runs = rp["replicas"], rp["runs"]
        rows = [[k, v.get("rc"), v.get("episodes"), v.get("rows"), v.get("seconds"), v.get("episodes_per_min")]
                for k, v in runs.items()]  # fmt: skip
        lines += [f"Collection through 1 and {n} replicas behind the proxy: speed-up {rp.get('speedup')}, "
                  f"efficiency {rp.get('efficiency')}", "",
                  md_table(["replicas", "rc", "episodes", "rows", "seconds", "episodes/min"], rows), ""]  # fmt: skip
    st = doc.get("store") or {}
    if st:
        names = list(st)
        cells = sorted({c for v in st.values() for c in v})
        rows = [[c, *[f"{(st[n].get(c) or {}).get('tau')} ({(st[n].get(c) or {}).get('requests')})" for n in names]]
                for c in cells]  # fmt: skip
        lines += ["The proxy's store: τ (requests) per workload/level", "", md_table(["cell", *names], rows)]
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "stage", choices=[*STAGES, "race", "replicas", "all", "down"], help="what to run (all: up to report, then down)"
    )
    p.add_argument("--work", default="/tmp/gpuloop", help="state, logs, traces, drafters (default: %(default)s)")
    p.add_argument("--backend", choices=("sglang", "dspine"), default="sglang")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target spec (built-in name or .gguf)")
    p.add_argument("--drafter", default=str(ROOT / "drafters/smollm2-135m-instruct/dspine"), help="base drafter")
    p.add_argument("--device", default="cuda", help="cuda or cpu (the fine-tune, the evaluation, dspine serve)")
    p.add_argument("--model", default="smol", help="the served model name")
    p.add_argument("--context", type=int, default=8192, help="the backend's context window")
    p.add_argument("--conversations", default="shipped", help="replay: the conversations (collect.py's)")
    p.add_argument("--max-conversations", type=int, default=0, help="replay: per workload (0: all)")
    p.add_argument("--replay-turns", type=int, default=0, help="replay: turns per conversation (0: every turn)")
    p.add_argument("--replay-tokens", type=int, default=64, help="replay: tokens generated per turn")
    p.add_argument("--live-episodes", type=int, default=4, help="live: episodes per workload × level (0: none)")
    p.add_argument("--live-workloads", default="swe,tool", help="live: harnesses")
    p.add_argument("--live-tokens", type=int, default=256, help="live: tokens per model call")
    p.add_argument("--concurrency", type=int, default=16, help="episodes (and replayed rows) at once")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="up: backends serving the model behind the proxy (replicas of the target on this machine; the deploy "
        "and the replays use the first)",
    )
    p.add_argument("--replica-conversations", type=int, default=8, help="replicas: conversations per workload")
    p.add_argument("--ray-cpus", type=int, default=None, help="the Ray head's CPUs (default: all)")
    p.add_argument(
        "--executor",
        choices=("ray", "local"),
        default="ray",
        help="ray: collection and fine-tune as Ray jobs on our head; local: the same scripts without Ray",
    )
    p.add_argument("--train-s", type=float, default=100.0, help="the fine-tune's time budget")
    p.add_argument(
        "--finetune-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an adapt/finetune.py setting (repeatable) replacing the recipe's, e.g. train.max_len=4096",
    )
    p.add_argument("--general-limit", type=int, default=3, help="the gate's general benchmarks: items each")
    p.add_argument("--general-workers", type=int, default=4)
    p.add_argument(
        "--eval-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an adapt/evaluate.py setting (repeatable), e.g. min_rows=1 for a rehearsal on a few rows",
    )
    p.add_argument("--tolerance", type=float, default=0.15, help="served vs engine τ of the same rows, relative")
    p.add_argument("--probe-clients", type=int, default=4, help="clients sending through the proxy during deploy")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a backend may take to start")
    p.add_argument("--race-rows", type=int, default=64, help="race: test rows sent at each concurrency")
    p.add_argument("--race-concurrency", default="1,4,16", help="race: concurrencies, comma-separated")
    p.add_argument("--sam-budget", type=int, default=8, help="race: NGRAM's draft nodes for its external corpus")
    p.add_argument("--dflash", help="race: a DFlash drafter (SGLang export) for the target, if one exists")
    p.add_argument("--out", help="JSON written by report (a .md beside it)")
    p.add_argument("--summary", help="summary.json whose gpu_loop section report rewrites")
    a = p.parse_args(argv)
    if a.replicas < 1:
        p.error(f"--replicas must be >= 1, not {a.replicas}")
    bad = [kv for kv in a.eval_set + a.finetune_set if "=" not in kv]
    if bad:
        p.error(f"--eval-set / --finetune-set take KEY=VALUE, not {bad[0]!r}")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    # every backend, proxy and job this script starts imports dspine from this checkout (start_backend and deploy
    # pass this process's environment on; the keys go through their configs)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    loop = Loop(a)
    stages = list(STAGES) if a.stage == "all" else [a.stage]
    try:
        for s in stages:
            t0 = time.time()
            getattr(loop, s)()
            loop.result.setdefault("stage_seconds", {})[s] = round(time.time() - t0, 1)
            loop.save()
    finally:
        if a.stage in ("all", "down"):
            loop.down()
    return 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
