"""`dspine dashboard`: a web page over the acceptance store — τ by workload × thinking level, per-slot
acceptance curves, τ over time, requests/s. One self-contained page, dashboard.html (inline SVG drawn by inline script,
no external network at view time) that polls /api/summary; binds 127.0.0.1 by default.

Every drawn mark carries its value as a data attribute (data-tau, data-workload, ...), so a browser test
can compare what was rendered with what the store holds.
"""

from __future__ import annotations

from pathlib import Path

from dspine.serve.store import AcceptanceStore

PAGE = Path(__file__).with_name("dashboard.html")  # the page, a static file beside this server


def create_app(store: AcceptanceStore, bucket_s: float = 60.0):
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse

    app = FastAPI(title="dspine dashboard", docs_url=None, redoc_url=None)

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE.read_text())

    @app.get("/api/summary")
    async def summary(since: float = 0.0):
        return store.summary(since=since, bucket_s=bucket_s)

    return app


def serve_dashboard(db: str, host: str = "127.0.0.1", port: int = 8050, bucket_s: float = 60.0) -> None:
    import uvicorn

    uvicorn.run(create_app(AcceptanceStore(db), bucket_s), host=host, port=port, log_level="warning")
