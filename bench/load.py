"""Load benchmark through the LiteLLM proxy: short streaming clients alone, then with long clients beside them.

Scenarios (`--scenarios`, comma-separated): `S` = S short streaming clients; `S+L` = S short clients plus L
clients asking `max_tokens` at the context limit (what the prompt leaves of the target's window), who hang up
at the deadline. Each runs `--seconds`; the table gives short requests' p50/p99 latency per scenario and each
mixed scenario's ratio to the short-only scenario of the same S (the serving issue's goal: ≤ 3×), errors and
lost records (abandoned long streams included).

Self-contained (starts `dspine serve` with the built-in target and the given drafter, then the proxy):
    python bench/load.py --start --drafter builtin --scenarios 32,32+4,64 \\
        --out bench/results/load.json --summary bench/results/summary.json
Against a running stack:
    DSPINE_PROXY_KEY=... python bench/load.py --proxy http://127.0.0.1:4000 --backend http://127.0.0.1:8000 \\
        --model smol --db runs/proxy/acceptance.db
Prints a table; writes JSON (git sha, command, hardware) and the `load` section of summary.json.
"""

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

from dspine.adapt.deployment import call_json
from dspine.io import atomic_write_text, md_table, provenance, update_summary
from dspine.serve.loadtest import LONG_PROMPT, run_load


def parse_scenario(text: str) -> tuple[int, int]:
    short, _, long = text.partition("+")
    try:
        return int(short), int(long or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"scenario {text!r} is not S or S+L (client counts)") from None


def long_max_tokens(proxy: str, backend: str, key: str, model: str) -> int:
    """The room the long prompt leaves in the target's window: max_model_len - its prompt tokens."""
    window = call_json(backend.rstrip("/") + "/v1/models")["data"][0]["max_model_len"]
    probe = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": LONG_PROMPT}]}
    used = call_json(proxy.rstrip("/") + "/v1/chat/completions", probe, key)["usage"]["prompt_tokens"]
    return window - used


def wait_idle(backend: str, timeout: float = 300) -> None:
    """Until the server has nothing admitted (abandoned rows aborted), so scenarios do not overlap."""
    deadline = time.time() + timeout
    while time.time() < deadline and call_json(backend.rstrip("/") + "/health")["admitted"]:
        time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy", help="proxy base URL (without --start)")
    ap.add_argument("--backend", help="the dspine serve base URL behind it (without --start)")
    ap.add_argument("--model", default="smol", help="model name at the proxy (default: %(default)s)")
    ap.add_argument("--db", help="the proxy's acceptance store, to count lost records")
    ap.add_argument("--start", action="store_true", help="start the server and the proxy here (127.0.0.1)")
    ap.add_argument("--drafter", default="builtin", help="drafter of the started server ('none': AR; default builtin)")
    ap.add_argument("--max-batch", type=int, default=8, help="the started server's --max-batch")
    ap.add_argument(
        "--scenarios",
        type=lambda s: [parse_scenario(x) for x in s.split(",")],
        default="32,32+4,64",
        help="S or S+L client counts, comma-separated (default: %(default)s)",
    )
    ap.add_argument("--seconds", type=float, default=60.0, help="each scenario's duration")
    ap.add_argument("--max-tokens", type=int, default=16, help="short requests' max_tokens")
    ap.add_argument("--out", help="JSON result file")
    ap.add_argument("--summary", help="summary.json whose `load` section is rewritten")
    a = ap.parse_args()
    procs = []
    runs = []
    try:
        if a.start:
            from dspine.process import free_port
            from dspine.serve.proxy import Backend, ProxyConfig, start_proxy, stop_proxy
            from dspine.serve.server import start_server_process

            work = Path(tempfile.mkdtemp(prefix="dspine-load-"))
            key = os.environ.get("DSPINE_PROXY_KEY") or "sk-" + secrets.token_hex(16)
            log = open(work / "stack.log", "w")
            drafter = None if a.drafter == "none" else a.drafter
            read = secrets.token_hex(16)  # the server's records (each request's τ) are read with it
            srv, backend = start_server_process(
                drafter, "backend", log=log, extra=["--max-batch", str(a.max_batch)], env={"DSPINE_READ_KEY": read}
            )
            procs.append(lambda: (srv.terminate(), srv.wait(timeout=60)))
            cfg = ProxyConfig(
                backends=[Backend(a.model, backend + "/v1", "backend")],
                port=free_port(),
                db=str(work / "acceptance.db"),
                workdir=str(work / "litellm"),
            )
            proxy_proc = start_proxy(cfg, key=key, log=log, read_key=read)
            procs.append(lambda: stop_proxy(proxy_proc))
            proxy, db = f"http://127.0.0.1:{cfg.port}", cfg.db
        else:
            if not (a.proxy and a.db and a.backend):
                ap.error("give --proxy, --backend and --db, or --start")
            proxy, backend, db, key = a.proxy, a.backend, a.db, os.environ.get("DSPINE_PROXY_KEY", "")
        room = long_max_tokens(proxy, backend, key, a.model) if any(lc for _, lc in a.scenarios) else 0
        for short, long in a.scenarios:
            wait_idle(backend)
            print(f"scenario {short}+{long}: {a.seconds:.0f} s ...", file=sys.stderr, flush=True)
            runs.append(run_load(proxy, key, a.model, db, short, a.seconds, a.max_tokens, long, room))
    finally:
        for stop in procs[::-1]:
            stop()
    base = {r["clients"]: r for r in runs if not r["long_clients"]}
    for r in runs:
        b = base.get(r["clients"]) if r["long_clients"] else None
        ok = b is not None and b["p50_ms"] and r["p50_ms"]
        r["p50_ratio"] = r["p50_ms"] / b["p50_ms"] if ok else None
        r["p99_ratio"] = r["p99_ms"] / b["p99_ms"] if ok else None
    res = {
        "scenarios": runs,
        "max_batch": a.max_batch,
        **provenance(),
        "backend": f"dspine serve (embedded engine, CPU), drafter {a.drafter}",
    }
    f = lambda v, d=0: "—" if v is None else f"{v:.{d}f}"
    header = [
        "short",
        "long",
        "completed",
        "errors",
        "lost",
        "p50 ms",
        "p99 ms",
        "p50 ×",
        "p99 ×",
        "req/s",
        "long tokens",
    ]
    rows = [
        [
            r["clients"],
            r["long_clients"],
            r["completed"],
            r["errors"],
            r["lost"],
            f(r["p50_ms"]),
            f(r["p99_ms"]),
            f(r["p50_ratio"], 2),
            f(r["p99_ratio"], 2),
            f(r["requests_per_s"], 2),
            ",".join(str(t) for t in r["long_tokens"]) or "—",
        ]
        for r in runs
    ]
    print(md_table(header, rows))
    if a.out:
        atomic_write_text(Path(a.out), json.dumps(res, indent=1) + "\n")
        atomic_write_text(Path(a.out).with_suffix(".md"), md_table(header, rows) + "\n")
    if a.summary:
        keep = ("clients", "long_clients", "completed", "errors", "lost", "p50_ms", "p99_ms", "p50_ratio", "p99_ratio")
        update_summary(
            a.summary,
            "load",
            {
                "scenarios": [{k: r[k] for k in keep} for r in runs],
                **{k: res[k] for k in ("git_sha", "hardware", "command")},
            },
        )
    return 0 if all(r["errors"] == 0 and r["lost"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
