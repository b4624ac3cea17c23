"""`dspine serve`: an OpenAI-compatible HTTP server over the embedded engine, answering in SGLang's shape.

Endpoints: /v1/chat/completions, /v1/responses (the Responses API over the chat path: serve.responses) and
/v1/completions (streaming and not), /v1/models, /health, /metrics
(Prometheus), and /v1/dspine/requests/{id} (the acceptance record of a finished request, the channel a proxy
callback reads for streamed requests, whose extra fields LiteLLM drops). Binds 127.0.0.1 by default.

Per-request acceptance comes back like SGLang 0.5.23: `sglext.spec_tokens_details` when the request sets
`return_spec_tokens_details`, `meta_info` when it sets `return_meta_info` (fields from stats.AcceptanceStats).
`reasoning_effort` (none/minimal/low/medium/high/xhigh) is mapped onto the target (Qwen3: `enable_thinking`; others: a
system instruction with a reasoning-token budget) and echoed in the record. One decoding thread (`Batcher`)
schedules at round boundaries (continuous batching): requests join a running batch between rounds and leave it as
they finish, so a late short request never waits for a long one; a client that disconnects aborts its own row at
its next round. `n` choices decode side by side and are recorded as one request (tokens and acceptance summed).

Several drafters beside one target: POST /v1/dspine/drafter with a `route` ("tool", or "tool/high") loads a drafter
for the requests of that workload (`metadata.workload`, which the proxy passes on) and thinking level; a request
takes the most specific route that matches it ("tool/high", then "tool"), else the default drafter. Every record
names the drafter that decoded it.
"""

import asyncio
import functools
import json
import sys
import threading

from dspine.engine import Engine
from dspine.process import free_port, wait_http
from dspine.serve.config import ServeConfig
from dspine.serve.drafters import Route, drafter_label
from dspine.serve.openai import (
    BadRequest,
    Parsed,
    Stream,
    apply_reasoning_effort,
    error_response,
    read_json,
    thinking_mode,
)
from dspine.serve.protocol import ROUTE, ROUTE_FORM, bearer_matches
from dspine.serve.records import RequestRecord
from dspine.serve.service import Service

__all__ = [
    "BadRequest",
    "Parsed",
    "Route",
    "ServeConfig",
    "Service",
    "Stream",
    "apply_reasoning_effort",
    "create_app",
    "drafter_label",
    "serve",
    "start_server_process",
    "thinking_mode",
]


async def sse(request, service: Service, streams: list[Stream]):
    """The SSE body of one streamed request (one Stream per choice); a client that disconnects stops its rows at
    their next token."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()

    def on_token(i: int, tok: int):
        streams[i].tokens.append(tok)
        loop.call_soon_threadsafe(events.put_nowait, ("tok", i))
        return not gone.is_set()

    def work():
        try:
            loop.call_soon_threadsafe(events.put_nowait, ("done", service.run(streams[0].req, on_token, gone)))
        except Exception as e:  # BadRequest, or what decoding raised: the client gets an error event
            loop.call_soon_threadsafe(events.put_nowait, ("error", e))

    # The place is released when decoding ends, not in `finally`: a client that hangs up cancels this generator,
    # and inside a cancelled scope every await is cancelled again, so nothing after one would run.
    task = loop.run_in_executor(None, work)
    task.add_done_callback(lambda _: service.release())
    try:
        while True:
            kind, payload = await events.get()
            if kind == "tok":
                out = streams[payload].progress()
                if out:
                    yield out
                if await request.is_disconnected():
                    gone.set()
            elif kind == "error":
                yield (
                    "data: "
                    + json.dumps({"error": {"message": str(payload), "type": "invalid_request_error"}})
                    + "\n\n"
                )
                break
            else:
                rec, results = payload
                for st, res in zip(streams, results):
                    for out in st.finish(res, rec if st is streams[-1] else None):
                        yield out
                yield "data: [DONE]\n\n"
                break
    finally:
        gone.set()  # the engine stops these rows at their next token


async def run_watched(request, service: Service, req: Parsed) -> tuple[RequestRecord, list]:
    """A non-streaming request, decoded in a worker thread while the connection is watched: a client that
    hangs up aborts its row at the next token (its record is kept, finish_reason "abort")."""
    gone = threading.Event()
    task = asyncio.ensure_future(asyncio.to_thread(service.run, req, None, gone))
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            gone.set()
    return task.result()


def swap_request(service: Service, authorization: str | None, raw: bytes) -> dict:
    """POST /v1/dspine/drafter: the admin key checked, the body parsed, the drafter swapped -> what changed;
    BadRequest (403 disabled, 401 wrong key, 400 bad body or a refused checkpoint) before anything changes."""
    from dspine.checkpoint import CheckpointError

    if not service.cfg.admin_key:
        raise BadRequest("drafter swaps are disabled: start dspine serve with --admin-key", status=403)
    if not bearer_matches(authorization, service.cfg.admin_key):
        raise BadRequest("a drafter swap needs the admin key (Authorization: Bearer ...)", status=401)
    body = read_json(raw)
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", param="drafter")
    unknown = sorted(set(body) - {"drafter", "name", "route", "remove"})
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}: drafter, name, route, remove", param=unknown[0])
    remove = body.get("remove", False)
    if not isinstance(remove, bool) or (remove and not isinstance(body.get("route"), str)):
        raise BadRequest("'remove' is true or false, and true only with a 'route'", param="remove")
    if not remove and not isinstance(body.get("drafter"), str):
        raise BadRequest("'drafter' must be a checkpoint folder, 'builtin' or 'none'", param="drafter")
    for key in ("name", "route"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise BadRequest(f"'{key}' must be a string", param=key)
    if body.get("route") is not None and not ROUTE.fullmatch(body["route"]):
        raise BadRequest(f"route {body['route']!r}: {ROUTE_FORM}", param="route")
    try:
        return service.swap_drafter(body.get("drafter", "none"), body.get("name"), body.get("route"), remove)
    except (CheckpointError, ValueError) as e:  # refused before the swap: the current drafter keeps serving
        raise BadRequest(f"drafter refused: {e}", param="drafter") from None


@functools.cache
def parser_pool():
    """The one thread that reads and tokenizes request bodies: a long prompt never blocks the event loop (health,
    other clients), and one thread keeps the tokenizer to one caller at a time (it is not safe to share)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(1, thread_name_prefix="dspine-parse")


def parse_body(service: Service, raw: bytes, content_type: str, chat: bool, responses: bool) -> tuple[Parsed, dict]:
    """A body -> (the Parsed request, the body as sent); BadRequest naming what is wrong."""
    from dspine.serve.protocol import RequestInvalid
    from dspine.serve.responses import to_chat

    body = asked = read_json(raw, content_type)
    if responses:
        try:
            body = to_chat(asked)
        except RequestInvalid as e:
            raise BadRequest(str(e), param=e.param) from None
    return service.parse(body, chat), asked


async def complete(request, service: Service, chat: bool, responses: bool = False):
    """One completion request: read, parse (off the event loop), admit, then stream or answer whole. `responses`:
    a Responses API request, decoded as the chat request it translates to (serve.responses) and answered in the
    Responses shape."""
    from fastapi.responses import JSONResponse, StreamingResponse

    from dspine.serve.responses import response_object, stream_events

    try:
        raw = await read_body(request, service.cfg.max_body_bytes, service.cfg.body_timeout_s)
        ctype = request.headers.get("content-type", "").lower()
        loop = asyncio.get_running_loop()
        req, asked = await loop.run_in_executor(parser_pool(), parse_body, service, raw, ctype, chat, responses)
        service.admit()
    except BadRequest as e:
        return error_response(service, e)
    headers = {"x-dspine-request-id": req.id}
    if req.stream:  # the stream releases its place when it ends
        streams = [Stream(service, req, chat, i) for i in range(req.n)]
        events = sse(request, service, streams)
        if responses:
            events = stream_events(events, asked, service.cfg.model_name)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    try:
        rec, results = await run_watched(request, service, req)
    except BadRequest as e:
        return error_response(service, e)
    finally:
        service.release()
    doc = service.response(req, rec, results, chat)
    return JSONResponse(response_object(doc, asked) if responses else doc, headers=headers)


async def read_body(request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, refused (413) as soon as it is known to be over `limit` bytes: from its Content-Length
    before anything is read, else while it streams in; one that has not arrived whole within `timeout_s` (a slow
    client, or a Content-Length larger than what was sent) is refused with 408."""
    size = request.headers.get("content-length", "")
    too_big = BadRequest(f"the request body is over {limit} bytes (--max-body-bytes)", status=413)
    if size.isdigit() and int(size) > limit:
        raise too_big

    async def whole() -> bytes:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise too_big
        return bytes(raw)

    try:
        return await asyncio.wait_for(whole(), timeout_s)
    except asyncio.TimeoutError:
        raise BadRequest(
            f"the request body did not arrive within {timeout_s:g} s (--body-timeout)", status=408
        ) from None


def probe(h: dict, key: str):
    from fastapi.responses import JSONResponse

    return JSONResponse(h, status_code=200 if h[key] else 503)


def dspine_routes(app, service: Service) -> None:
    """dspine's own routes: the drafter (read, hot swap) and the finished requests' records."""
    from fastapi import Request

    def error(e: BadRequest):
        return error_response(service, e)

    def refused(request: Request):
        """The reads' key check: None when the read key or the admin key came with the request, else the error."""
        cfg = service.cfg
        if not (cfg.read_key or cfg.admin_key):
            msg = "records and drafter reads are closed: start dspine serve with --read-key (or --admin-key)"
            return error(BadRequest(msg, status=403))
        if not bearer_matches(request.headers.get("authorization"), cfg.read_key, cfg.admin_key):
            return error(BadRequest("this read needs the read key (Authorization: Bearer ...)", status=401))
        return None

    @app.get("/v1/dspine/drafter")
    async def drafter_info(request: Request):
        return refused(request) or service.drafters()

    @app.post("/v1/dspine/drafter")
    async def drafter_swap(request: Request):  # {"drafter": FOLDER | "builtin" | "none", "name", "route", "remove"}
        from starlette.concurrency import run_in_threadpool

        try:
            return await run_in_threadpool(
                swap_request, service, request.headers.get("authorization"), await request.body()
            )
        except BadRequest as e:
            return error(e)

    @app.get("/v1/dspine/requests")
    async def recent(request: Request, limit: int = 20):  # the latest finished requests' records, newest first
        if (no := refused(request)) is not None:
            return no
        return {"data": [r.to_json() for r in list(service.records.values())[-max(1, min(limit, 1000)) :][::-1]]}

    @app.get("/v1/dspine/requests/{rid}")
    async def record(request: Request, rid: str):
        if (no := refused(request)) is not None:
            return no
        rec = service.records.get(rid)
        if rec is None:
            return error(BadRequest(f"no finished request {rid!r}", status=404))
        return rec.to_json()


def create_app(service: Service):
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException

    app = FastAPI(title="dspine", docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown paths and methods, in OpenAI's shape
        what = {
            404: f"no such endpoint: {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }
        return error(BadRequest(what.get(exc.status_code, str(exc.detail)), status=exc.status_code))

    def error(e: BadRequest):
        return error_response(service, e)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # a bug, never client input: JSON, an id, a log line
        import logging
        import uuid

        eid = uuid.uuid4().hex[:12]
        logging.getLogger("dspine.serve").error(
            "internal error %s on %s %s", eid, request.method, request.url.path, exc_info=exc
        )
        return error(BadRequest(f"internal server error (id {eid}, logged)", status=500, code="internal_error"))

    def completion_route(chat: bool, responses: bool):
        async def route(request: Request):
            return await complete(request, service, chat, responses)

        return route

    # chat completions, the Responses API over the chat path (serve.responses), text completions
    for path, chat, responses in (
        ("chat/completions", True, False),
        ("responses", True, True),
        ("completions", False, False),
    ):
        app.add_api_route(f"/v1/{path}", completion_route(chat, responses), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": service.cfg.model_name,
                    "object": "model",
                    "owned_by": "dspine",
                    "drafter": service.drafter_name,
                    "method": service.engine.method,
                    "target": service.engine.target.name,
                    "max_model_len": service.engine.max_positions,
                    "reasoning_effort": thinking_mode(service.engine.target.info.model_type),
                    "chat_template_sha256": service.template_sha256,
                }
            ],
        }

    @app.get("/health")
    async def health():  # liveness: 503 when the decode loop died or stalled
        return probe(service.health(), "live")

    @app.get("/ready")
    async def ready():  # readiness: 503 while shutting down or with the queue full
        return probe(service.health(), "ready")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    dspine_routes(app, service)
    return app


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    cfg: ServeConfig | None = None,
    drafter_name: str | None = None,
    drafter_path: str | None = None,
    routes: dict[str, str] | None = None,
) -> None:
    """Serve until SIGTERM / SIGINT. `routes` {WORKLOAD[/LEVEL]: checkpoint}: drafters beside the default one,
    loaded (and checked against the target) before the port opens."""
    import uvicorn

    service = Service(engine, cfg, drafter_name)
    service.drafter_path = drafter_path
    for route, path in (routes or {}).items():
        service.swap_drafter(path, None, route)
    mode = thinking_mode(engine.target.info.model_type)
    if mode["mode"] != "enable_thinking":
        print(f"dspine serve: reasoning_effort on {engine.target.name}: {mode['detail']}", file=sys.stderr, flush=True)
    grace = service.cfg.grace_s

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / SIGINT: stop admitting; abort what outlives the grace
            service.begin_shutdown(grace)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        create_app(service), host=host, port=port, log_level="warning", timeout_graceful_shutdown=int(grace) + 5
    )
    Server(config).run()


def start_server_process(
    drafter: str | None = None,
    name: str = "dspine",
    target: str | None = None,
    port: int | None = None,
    extra: list[str] | None = None,
    log=None,
    env: dict | None = None,
):
    """`dspine serve` as a child process on 127.0.0.1 -> (process, base URL), once /health answers. `env`: added
    to this process's environment (keys: DSPINE_READ_KEY, DSPINE_ADMIN_KEY — never on the command line)."""
    import os
    import subprocess
    import sys

    port = port or free_port()
    cmd = [sys.executable, "-m", "dspine.cli", "serve", "--port", str(port), "--served-model-name", name]
    cmd += ["--drafter", str(drafter) if drafter else "none"] + (["--target", target] if target else []) + (extra or [])
    proc = subprocess.Popen(
        cmd, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", proc, 240)
    return proc, base
