"""`dspine dashboard`: a web page over the acceptance store — τ by workload × thinking level, per-slot
acceptance curves, τ over time, requests/s — and, given the adaptation loop's folder (`--loop`), each iteration's
held-out τ base vs adapted per workload × level and the deploy history. One self-contained page, dashboard.html
(inline SVG drawn by inline script, no external network at view time) that polls /api/summary and
/api/adaptation; binds 127.0.0.1 by default.

Every drawn mark carries its value as a data attribute (data-tau, data-workload, ...), so a browser test
can compare what was rendered with what the store holds.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspine.serve.store import AcceptanceStore

PAGE = Path(__file__).with_name("dashboard.html")  # the page, a static file beside this server


def adaptation_record(loop: str | Path | None) -> dict:
    """The adaptation loop's folder (adapt/loop.py's WORK) -> {"iterations": loop.json's entries (held-out τ base vs
    adapted per cell, the general regression, the deploys), "deploys": deploys.jsonl's entries}; a file that is
    absent or being rewritten reads as empty (both are replaced atomically, so a reader never sees half of one)."""
    out: dict = {"iterations": [], "deploys": []}
    if not loop:
        return out
    loop = Path(loop)
    try:
        out["iterations"] = json.loads((loop / "loop.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass
    try:
        lines = (loop / "deploys.jsonl").read_text().splitlines()
        out["deploys"] = [json.loads(x) for x in lines if x.strip()]
    except (OSError, json.JSONDecodeError):
        pass
    return out


def create_app(store: AcceptanceStore, bucket_s: float = 60.0, loop: str | Path | None = None):
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse

    app = FastAPI(title="dspine dashboard", docs_url=None, redoc_url=None)

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE.read_text())

    @app.get("/api/summary")
    async def summary(since: float = 0.0):
        return store.summary(since=since, bucket_s=bucket_s)

    @app.get("/api/adaptation")
    async def adaptation():
        return adaptation_record(loop)

    return app


def serve_dashboard(
    db: str, host: str = "127.0.0.1", port: int = 8050, bucket_s: float = 60.0, loop: str | None = None
) -> None:
    import uvicorn

    uvicorn.run(create_app(AcceptanceStore(db), bucket_s, loop), host=host, port=port, log_level="warning")
