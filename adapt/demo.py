"""`make demo`: the main job, end to end on this machine (CPU) — a local Ray head, `dspine serve` with the
shipped drafter, the LiteLLM proxy in front of it; agent traffic through the proxy as a Ray job — by default
real agent conversations replayed (a small fixed set of the shipped tau-bench airline and SWE conversations,
`--traffic replay`), or the live agent harness at two thinking levels (`--traffic live`); then one turn of
the closed loop (adapt/cycle.py): the proxy's records -> traces ->
fine-tune under Ray Train -> held-out replay per workload × level + general benchmarks -> gate -> swap into the
running server with a live check; a few requests through the proxy on the new drafter; the table.

    python adapt/demo.py [--work runs/demo] [--traffic replay|live] [--steps 40] [--keep]

Sizes are small enough for a 2-core machine; every stage says what it does and how long it took. --keep
leaves the server, proxy and Ray head running (the dashboard: `dspine dashboard --db WORK/proxy.db --loop WORK/loop`).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Stages:
    def __init__(self, total: int):
        self.total, self.n, self.t0, self.t = total, 0, time.time(), time.time()

    def __call__(self, what: str) -> None:
        now = time.time()
        if self.n:
            print(f"      done in {now - self.t:.0f} s", flush=True)
        self.n, self.t = self.n + 1, now
        print(f"[{self.n}/{self.total} · {now - self.t0:4.0f} s] {what}", flush=True)


def proxy_chat(proxy: str, key: str, workload: str, level: str, prompt: str) -> str:
    from dspine.adapt.deployment import call_json

    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 32,
        "temperature": 0,
        "reasoning_effort": level,
        "metadata": {"workload": workload},
    }
    return call_json(proxy + "/v1/chat/completions", body, key)["id"]


def table(it: dict, doc: dict) -> str:
    from dspine.adapt.evaluation import cells_table

    out = cells_table(doc) + f"\n\n(split by {doc.get('split') or 'episode'}; a demonstration on a few rows)"
    g = doc.get("general") or {}
    if g:
        out += "\n\ngeneral benchmarks (" + ", ".join(g["benchmarks"]) + f", T = 0): τ base {g['tau_mean']['base']:.3f}"
        out += "".join(
            f", {n} {t:.3f} (τ {-g['regression'][n]:+.1%} vs base)" for n, t in g["tau_mean"].items() if n != "base"
        )
    gate = "; ".join(
        f"{n}: {'accept' if d['accept'] else 'refuse (' + ', '.join(d['reasons']) + ')'}"
        for n, d in doc["gate"].items()
    )
    deploys = "; ".join(
        f"{d['group']}: {d['action']}" + (f" (live τ {d['live']['tau']:.3f})" if d.get("live") else "")
        for d in it["deploys"]
    )
    return out + f"\n\ngate: {gate}\ndeploy: {deploys}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="adapt/demo.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--work", default="runs/demo")
    ap.add_argument(
        "--traffic",
        choices=("replay", "live"),
        default="replay",
        help="replay: recorded agent conversations replayed through the proxy; live: the agent harness runs",
    )
    ap.add_argument("--conversations", type=int, default=4, help="replay: conversations per workload (one per task)")
    ap.add_argument(
        "--max-context",
        type=int,
        default=4096,
        help="replay: the longest prompt + reply (longer contexts cut from the left at a message boundary, the "
        "system message kept), and the server's window for prompts: on a CPU the prefills are most of the demo's time",
    )
    ap.add_argument("--workload", default="tool", help="live: agent workload collected (tool, office, swe)")
    ap.add_argument("--levels", default=None, help="thinking levels (default: none for replay, low,high for live)")
    ap.add_argument("--episodes", type=int, default=3, help="live: per level (one of each level's is held out)")
    ap.add_argument("--steps", type=int, default=40, help="fine-tuning steps")
    ap.add_argument("--keep", action="store_true", help="leave the server, proxy and Ray head running")
    a = ap.parse_args(argv)
    replay = a.traffic == "replay"
    a.levels = a.levels or ("none" if replay else "low,high")

    from dspine.adapt.cluster import LocalRayHead, ray_env
    from dspine.adapt.cycle import LoopConfig, run_iteration
    from dspine.adapt.deployment import DeployConfig
    from dspine.adapt.evaluation import EvalConfig
    from dspine.adapt.finetuning import FinetuneConfig
    from dspine.process import free_port
    from dspine.serve.proxy import ProxyConfig, parse_backend, start_proxy, stop_proxy
    from dspine.serve.server import start_server_process
    from dspine.serve.store import AcceptanceStore
    from dspine.train.loop import TrainConfig

    work = Path(a.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = ray_env()
    os.environ.update(
        {k: env[k] for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    )
    head = None
    stage = Stages(7)
    admin, master = secrets.token_hex(8), "sk-demo-" + secrets.token_hex(8)
    server = proxy = None
    try:
        stage("Ray head on 127.0.0.1 (its own temp dir and ports)")
        head = LocalRayHead()
        address, dashboard = head.address, head.dashboard
        os.environ["RAY_ADDRESS"] = address  # Ray Train (fine-tune) joins this head
        stage("dspine serve: SmolLM2-135M-Instruct + the shipped DSpine drafter (swappable: --admin-key)")
        log = open(work / "server.log", "wb")
        server, base = start_server_process(
            "builtin",
            "smol",
            extra=["--max-prompt-tokens", str(a.max_context)],
            log=log,
            env={"DSPINE_ADMIN_KEY": admin},
        )
        stage("LiteLLM proxy in front of it, recording every request in a SQLite store")
        cfg = ProxyConfig(
            backends=[parse_backend(f"smol={base}/v1@smol")],
            port=free_port(),
            db=str(work / "proxy.db"),
            workdir=str(work / "proxy"),
        )
        proxy = start_proxy(cfg, key=master, log=open(work / "proxy.log", "wb"), read_key=admin)  # server's records
        purl = f"http://127.0.0.1:{cfg.port}"
        if replay:
            from dspine.agents.replay import shipped

            convs = f"{shipped() / 'tau_bench_airline_gpt4o'},{shipped() / 'swe_adp_samples'}"
            stage(
                f"replay {a.conversations} tau-bench airline and {a.conversations} SWE conversations (2 turns each, "
                f"levels {a.levels}) through the proxy: a Ray job"
            )
            what = [
                "--source",
                "replay",
                "--conversations",
                convs,
                "--max-conversations",
                str(a.conversations),
                "--max-turns",
                "2",
                "--max-tokens",
                "48",
                "--max-context",
                str(a.max_context),
                "--tokenizer",  # the proxy's /v1/models does not name the target: its rendering decides the cuts
                "smollm2-135m-instruct",
            ]
        else:
            stage(f"collect {a.episodes} {a.workload} episodes per level ({a.levels}) through the proxy: a Ray job")
            what = ["--workloads", a.workload, "--episodes", str(a.episodes), "--max-turns", "1", "--max-tokens", "64"]
        cmd = [
            "ray",
            "job",
            "submit",
            "--address",
            dashboard,
            "--working-dir",
            str(ROOT),
            "--",
            "python",
            "adapt/collect.py",
            "--endpoint",
            purl + "/v1",
            "--api-key",
            master,
            "--model",
            "smol",
            "--out",
            str(work / "collected"),
            "--levels",
            a.levels,
            "--concurrency",
            "2",
            *what,
        ]
        job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        (work / "collect.log").write_text(job.stdout + job.stderr)
        if job.returncode:
            print(job.stdout[-2000:], job.stderr[-2000:], file=sys.stderr)
            return 1
        acc = json.loads((work / "collected" / "accounts.json").read_text())
        want = acc["replay"]["turns_planned"] if replay else a.episodes * len(a.levels.split(","))
        for _ in range(120):  # the proxy writes its records after answering
            if len(AcceptanceStore(cfg.db).traces()) >= want:
                break
            time.sleep(0.5)
        stage(f"adapt: records -> traces -> fine-tune ({a.steps} steps, Ray Train) -> held-out replay + gate -> deploy")
        loop = LoopConfig(
            store=cfg.db,
            work=str(work / "loop"),
            min_rows=2,
            finetune=FinetuneConfig(
                base="builtin",
                workers=1,
                heldout_fraction=0.25 if replay else 0.34,
                validation_fraction=0.25 if replay else 0.0,
                # replay: by task (a task's turns on one side); a few live CPU episodes are too few tasks for that
                split="task" if replay else "episode",
                train=TrainConfig(
                    steps=a.steps,
                    batch_size=2,
                    anchors_per_seq=16,
                    max_len=768,
                    lr=5e-5,
                    warmup_steps=4,
                    eval_every=1000,
                ),
            ),
            # a demonstration on a few rows: the minimum per cell lowered (the table prints rows and tasks)
            evaluate=EvalConfig(benchmarks=["gsm8k", "mt_bench"], limit=1, max_new_tokens=32, min_rows=1, min_tasks=1),
            deploy=DeployConfig(endpoint=base, admin_key=admin, live_requests=2, max_tokens=32, live_tolerance=0.5),
        )
        it = run_iteration(loop, progress=True)
        if it["action"] != "adapted":
            print(f"nothing adapted: {it.get('reason')}", file=sys.stderr)
            return 1
        doc = json.loads((work / "loop" / "iter-000" / "adapt.json").read_text())
        stage("requests through the proxy on the deployed drafter")
        w = "tool_replay" if replay else a.workload
        ids = [proxy_chat(purl, master, w, lv, "Name three prime numbers.") for lv in a.levels.split(",")]
        time.sleep(1.0)
        served = {r["request_id"]: r["drafter"] for r in AcceptanceStore(cfg.db).rows()}
        stage("result")
        print(table(it, doc))
        print("proxy requests served by: " + ", ".join(sorted({str(served.get(i)) for i in ids})))
        print(
            f"\nrecords: {cfg.db}; the dashboard (live τ, base vs adapted, deploys): dspine dashboard --db {cfg.db} "
            f"--loop {work / 'loop'}  (then http://127.0.0.1:8050)"
        )
        print(f"adapt.json / adapt.md: {work / 'loop' / 'iter-000'}; deploy history: {work / 'loop' / 'deploys.jsonl'}")
        return 0
    finally:
        if not a.keep:
            if proxy is not None:
                stop_proxy(proxy)
            if server is not None:
                server.terminate()
                server.wait(30)
            if head is not None:
                import ray

                if ray.is_initialized():  # this process joined the head for Ray Train: leave before it stops
                    ray.shutdown()
                head.stop()  # its own processes only, by their ids
        print(f"total {time.time() - stage.t0:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
