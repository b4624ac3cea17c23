"""Load through the proxy: concurrent streaming clients for a fixed time, then the accounting.

Short clients send streaming chat requests back to back (workloads and thinking levels in rotation, tagged
the way agent frameworks tag them) until the time is up; requests already sent are let finish. Long clients
ask for `max_tokens` at the context limit (the window the prompt leaves; `ignore_eos`, so they decode that long
unless stopped) and hang up at the deadline, as an
agent that gives up would: their rows are aborted by the server and must still reach the store. Reported:
completed, errors (a non-200 answer, an error event in the stream, a broken connection), lost records
(requests that streamed an id — completed or abandoned — and never reached the acceptance store), short
requests' latency p50/p99 (sent → last event) and throughput. Speed lives here, not in timed tests.
"""

from __future__ import annotations

import asyncio
import json
import time

from dspine.serve.store import AcceptanceStore
from dspine.stats import quantile

PROMPTS = [
    "Explain what a race condition is in two sentences.",
    "Write a haiku about version control.",
    "Give three uses of a hash map.",
    "What does HTTP status 404 mean?",
    "Suggest a name for a function that parses dates.",
    "List two benefits of unit tests.",
]
LONG_PROMPT = "Count from 1 to 10000, one number per line, without stopping."
WORKLOADS = ("swe", "tool_use", "office")
EFFORTS = ("none", "low", "high")


def _body(i: int, n: int, model: str, max_tokens: int, long: bool) -> dict:
    prompt = LONG_PROMPT if long else PROMPTS[(i + n) % len(PROMPTS)]
    return {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": prompt}],
        "metadata": {"workload": "long" if long else WORKLOADS[(i + n) % len(WORKLOADS)]},
        "reasoning_effort": "none" if long else EFFORTS[(i // len(WORKLOADS) + n) % len(EFFORTS)],
        # a long client decodes to its max_tokens (LiteLLM passes extra_body's fields on to the backend)
        **({"extra_body": {"ignore_eos": True}} if long else {}),
    }


async def _client(i, http, url, key, body_of, deadline: float, long: bool, out: list):
    n = 0
    while time.time() < deadline:
        body = body_of(i, n)
        n += 1
        t0 = time.perf_counter()
        rec = {"client": i, "long": long, "id": None, "error": None, "tokens": 0, "aborted": False}
        try:
            async with http.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                if r.status_code != 200:
                    rec["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                else:
                    done = False
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            done = True
                            break
                        ev = json.loads(data)
                        if "error" in ev:
                            rec["error"] = str(ev["error"])[:200]
                            break
                        rec["id"] = ev.get("id", rec["id"])
                        rec["tokens"] += 1
                        if long and time.time() > deadline:
                            rec["aborted"] = True  # the client hangs up: the server aborts the row
                            break
                    if not done and rec["error"] is None and not rec["aborted"]:
                        rec["error"] = "stream ended without [DONE]"
        except Exception as e:  # a broken connection or timeout is an error to count, not a crash
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        rec["latency_ms"] = (time.perf_counter() - t0) * 1000
        out.append(rec)


async def _run(proxy, key, model, clients, long_clients, seconds, max_tokens, long_max_tokens, drain_s):
    import httpx

    url = proxy.rstrip("/") + "/v1/chat/completions"
    out: list[dict] = []
    total = clients + long_clients
    limits = httpx.Limits(max_connections=total + 4, max_keepalive_connections=total + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(seconds + drain_s), limits=limits) as http:
        t0 = time.time()
        deadline = t0 + seconds
        short = lambda i, n: _body(i, n, model, max_tokens, False)
        long = lambda i, n: _body(i, n, model, long_max_tokens, True)
        tasks = [_client(i, http, url, key, short, deadline, False, out) for i in range(clients)]
        tasks += [_client(clients + i, http, url, key, long, deadline, True, out) for i in range(long_clients)]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=seconds + drain_s + 30)
    return out, time.time() - t0


def run_load(
    proxy: str,
    key: str,
    model: str,
    db: str,
    clients: int = 64,
    seconds: float = 60.0,
    max_tokens: int = 16,
    long_clients: int = 0,
    long_max_tokens: int = 0,
    drain_s: float = 600.0,
    settle_s: float = 60.0,
) -> dict:
    """Drive the proxy; then wait up to `settle_s` for the store to hold every request that got an id."""
    since = time.time()
    out, wall = asyncio.run(
        _run(proxy, key, model, clients, long_clients, seconds, max_tokens, long_max_tokens, drain_s)
    )
    ok = [r for r in out if r["error"] is None]
    want = {r["id"] for r in ok if r["id"]}
    store = AcceptanceStore(db)
    deadline = time.time() + settle_s
    while True:
        rows = {r["request_id"]: r for r in store.rows(since - 1)}
        if want <= set(rows) or time.time() > deadline:
            break
        time.sleep(0.5)
    short = [r for r in ok if not r["long"]]
    long = [r for r in ok if r["long"]]
    lat = [r["latency_ms"] for r in short]
    errors = [r["error"] for r in out if r["error"] is not None]
    long_rows = [rows[r["id"]] for r in long if r["id"] in rows]
    return {
        "clients": clients,
        "long_clients": long_clients,
        "seconds": seconds,
        "wall_s": wall,
        "max_tokens": max_tokens,
        "long_max_tokens": long_max_tokens,
        "sent": len(out),
        "completed": len(short),
        "errors": len(errors),
        "lost": len(want - set(rows)),
        "p50_ms": quantile(lat, 0.5),
        "p99_ms": quantile(lat, 0.99),
        "max_ms": max(lat) if lat else None,
        "requests_per_s": len(short) / wall if wall else 0.0,
        "stream_events_per_s": sum(r["tokens"] for r in ok) / wall if wall else 0.0,
        "long_requests": len(long),
        "long_aborted": sum(r["aborted"] for r in long),
        "long_tokens": [r.get("completion_tokens") for r in long_rows],
        "long_tau": [r.get("tau") for r in long_rows],
        "error_examples": sorted(set(errors))[:5],
    }
