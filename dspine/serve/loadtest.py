"""Load through the proxy: N concurrent streaming clients for a fixed time, then the accounting.

Each client sends streaming chat requests back to back (workloads and thinking levels in rotation, tagged
the way agent frameworks tag them) until the time is up; requests already sent are let finish. Reported:
completed, errors (a non-200 answer, an error event in the stream, a broken connection), lost records
(completed requests that never reached the acceptance store), latency p50/p99 (request sent → last event)
and throughput. Speed lives here, not in timed tests.
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
WORKLOADS = ("swe", "tool_use", "office")
EFFORTS = ("none", "low", "high")


async def _client(i: int, http, url: str, key: str, model: str, deadline: float, max_tokens: int, out: list):
    n = 0
    while time.time() < deadline:
        body = {
            "model": model,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}],
            "metadata": {"workload": WORKLOADS[(i + n) % len(WORKLOADS)]},
            "reasoning_effort": EFFORTS[(i // len(WORKLOADS) + n) % len(EFFORTS)],
        }
        n += 1
        t0 = time.perf_counter()
        rec = {"client": i, "id": None, "error": None, "tokens": 0}
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
                    if not done and rec["error"] is None:
                        rec["error"] = "stream ended without [DONE]"
        except Exception as e:  # a broken connection or timeout is an error to count, not a crash
            rec["error"] = f"{type(e).__name__}: {e}"[:200]
        rec["latency_ms"] = (time.perf_counter() - t0) * 1000
        out.append(rec)


async def _run(
    proxy: str, key: str, model: str, clients: int, seconds: float, max_tokens: int, drain_s: float
) -> tuple[list[dict], float]:
    import httpx

    url = proxy.rstrip("/") + "/v1/chat/completions"
    out: list[dict] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(seconds + drain_s), limits=limits) as http:
        t0 = time.time()
        deadline = t0 + seconds
        await asyncio.wait_for(
            asyncio.gather(*[_client(i, http, url, key, model, deadline, max_tokens, out) for i in range(clients)]),
            timeout=seconds + drain_s + 30,
        )
    return out, time.time() - t0


def run_load(
    proxy: str,
    key: str,
    model: str,
    db: str,
    clients: int = 64,
    seconds: float = 60.0,
    max_tokens: int = 16,
    drain_s: float = 600.0,
    settle_s: float = 30.0,
) -> dict:
    """Drive the proxy; then wait up to `settle_s` for the store to hold every completed request."""
    since = time.time()
    out, wall = asyncio.run(_run(proxy, key, model, clients, seconds, max_tokens, drain_s))
    ok = [r for r in out if r["error"] is None]
    want = {r["id"] for r in ok}
    store = AcceptanceStore(db)
    deadline = time.time() + settle_s
    while True:
        got = {r["request_id"] for r in store.rows(since - 1)}
        if want <= got or time.time() > deadline:
            break
        time.sleep(0.5)
    lat = [r["latency_ms"] for r in ok]
    errors = [r["error"] for r in out if r["error"] is not None]
    return {
        "clients": clients,
        "seconds": seconds,
        "wall_s": wall,
        "max_tokens": max_tokens,
        "sent": len(out),
        "completed": len(ok),
        "errors": len(errors),
        "lost": len(want - got),
        "p50_ms": quantile(lat, 0.5),
        "p99_ms": quantile(lat, 0.99),
        "max_ms": max(lat) if lat else None,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "stream_events_per_s": sum(r["tokens"] for r in ok) / wall if wall else 0.0,
        "error_examples": sorted(set(errors))[:5],
    }
