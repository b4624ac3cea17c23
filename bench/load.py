"""Load benchmark: 64 concurrent streaming clients for 60 s through the LiteLLM proxy (issue: serving).

Against a running proxy:
    DSPINE_PROXY_KEY=... python bench/load.py --proxy http://127.0.0.1:4000 --model smol --db runs/proxy/acceptance.db
Or self-contained (starts `dspine serve` with the built-in target and the given drafter, then the proxy):
    python bench/load.py --start --drafter runs/demo/best --out bench/results/load.json \
        --summary bench/results/summary.json
Prints a table; writes JSON (git sha, command, hardware) and the `load` section of summary.json.
"""

import argparse
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path

from dspine.io import atomic_write_text, md_table, provenance, update_summary
from dspine.serve.loadtest import run_load


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy", help="proxy base URL (without --start)")
    ap.add_argument("--model", default="smol", help="model name at the proxy (default: %(default)s)")
    ap.add_argument("--db", help="the proxy's acceptance store, to count lost records")
    ap.add_argument("--start", action="store_true", help="start the server and the proxy here (127.0.0.1)")
    ap.add_argument("--drafter", help="drafter checkpoint for the started server (default: AR)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", help="JSON result file")
    ap.add_argument("--summary", help="summary.json whose `load` section is rewritten")
    a = ap.parse_args()
    procs = []
    try:
        if a.start:
            from dspine.process import free_port
            from dspine.serve.proxy import Backend, ProxyConfig, start_proxy
            from dspine.serve.server import start_server_process

            work = Path(tempfile.mkdtemp(prefix="dspine-load-"))
            key = os.environ.get("DSPINE_PROXY_KEY") or "sk-" + secrets.token_hex(16)
            log = open(work / "stack.log", "w")
            srv, base = start_server_process(a.drafter, "backend", log=log)
            procs.append(srv)
            cfg = ProxyConfig(
                backends=[Backend(a.model, base + "/v1", "backend")],
                port=free_port(),
                db=str(work / "acceptance.db"),
                workdir=str(work / "litellm"),
            )
            procs.append(start_proxy(cfg, key=key, log=log))
            proxy, db = f"http://127.0.0.1:{cfg.port}", cfg.db
        else:
            if not (a.proxy and a.db):
                ap.error("give --proxy and --db, or --start")
            proxy, db, key = a.proxy, a.db, os.environ.get("DSPINE_PROXY_KEY", "")
        res = run_load(proxy, key, a.model, db, a.clients, a.seconds, a.max_tokens)
    finally:
        for p in procs[::-1]:
            p.terminate()
            p.wait(timeout=30)
    res.update(**provenance(), backend=f"dspine serve (embedded engine, CPU), drafter {a.drafter or 'none (AR)'}")
    f = lambda v: "—" if v is None else f"{v:.0f}"
    header = ["clients", "seconds", "completed", "errors", "lost", "p50 ms", "p99 ms", "req/s"]
    row = [res["clients"], f"{res['seconds']:.0f}", res["completed"], res["errors"], res["lost"], f(res["p50_ms"]),
           f(res["p99_ms"]), f"{res['requests_per_s']:.2f}"]  # fmt: skip
    print(md_table(header, [row]))
    if a.out:
        atomic_write_text(Path(a.out), json.dumps(res, indent=1) + "\n")
    if a.summary:
        update_summary(
            a.summary,
            "load",
            {
                k: res[k]
                for k in (
                    "clients",
                    "seconds",
                    "completed",
                    "errors",
                    "lost",
                    "p50_ms",
                    "p99_ms",
                    "git_sha",
                    "hardware",
                    "command",
                )
            },
        )
    return 0 if res["errors"] == 0 and res["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
