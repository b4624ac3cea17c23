"""The proxy's request gate: what LiteLLM's app sees only after dspine has checked it.

LiteLLM parses a request body leniently (a body it cannot read becomes `{}`, a form is read as fields) and
turns what its provider code trips over into 500s, so a malformed request through the proxy used to answer
"Missing required parameter 'messages'" or an internal error. The gate is a pure ASGI middleware in front of
LiteLLM's app for the OpenAI completion routes (chat, text and the Responses API): a POST without the master key
answers 401 (LiteLLM would parse the body first and could answer 500); one with it is read whole, parsed by the
server's own functions (protocol.read_json, responses.to_chat, protocol.parse_request) and, when bad, answered
with the same 4xx and message the server would give, before LiteLLM runs (fields a backend may or may not
implement, such as `logit_bias`, are left to the backend); an unknown model answers 404 as the server does. A good
body goes on as the JSON the server would read (UTF-8, whatever encoding it came in: a BOM or UTF-16 body is read
alike on both), its Content-Type made application/json (a JSON body sent as a form by `curl -d` is still JSON).
While LiteLLM answers a request that is not streamed, the gate watches the client: one that hangs up or times out
cancels the request, so the backend aborts its decode instead of finishing it for no one (a stream sees its
client go itself). A body slower than DSPINE_PROXY_BODY_TIMEOUT
answers 408; LiteLLM's routes that would skip the gate (Azure-style and engine paths) and its admin UI are closed.
At shutdown (SIGTERM: `drain_then`) the proxy keeps its port and answers new completion requests 503 with
Retry-After while the open ones finish, and exits only once every answered request is recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

from dspine.serve.protocol import RequestInvalid, error_body, parse_request, read_json
from dspine.serve.protocol import key_matches as protocol_key_matches

KEY_REFUSED = "invalid or missing proxy key (Authorization: Bearer <key>)"
# the gated routes -> what their body is: a chat request, a text completion, or a Responses request (serve.responses)
GATED = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completions",
    "/completions": "completions",
    "/v1/responses": "responses",
    "/responses": "responses",
}
# LiteLLM routes that would skip the gate (the Azure-style and engine paths carry the model in the path) or show
# its admin UI without the key: closed (the UI opens with DSPINE_PROXY_UI=1)
CLOSED = ("/openai/deployments", "/engines", "/ui", "/litellm/ui")
MAX_BODY = 32 * 2**20
# gated requests being answered, answered 200, and recorded by the acceptance callback
COUNTS = {"inflight": 0, "answered": 0, "logged": 0}
DRAIN: dict = {"since": None}  # set at the first SIGTERM: new completion requests get 503 + Retry-After
GRACE_S = float(os.environ.get("DSPINE_PROXY_GRACE", "120"))  # the longest a drain waits for open requests
BODY_TIMEOUT_S = float(os.environ.get("DSPINE_PROXY_BODY_TIMEOUT", "30"))  # slower bodies get 408 (--body-timeout)


def key_matches(given: str | None, key: str | None = None) -> bool:
    """Constant-time comparison with the proxy's master key (None: DSPINE_PROXY_KEY); no key set: nothing matches."""
    return protocol_key_matches(given or "", key if key is not None else os.environ.get("DSPINE_PROXY_KEY", ""))


def drain_then(exit_now, grace_s: float | None = None) -> None:
    """The proxy's first SIGTERM: from now on new completion requests answer 503 with Retry-After (the port stays
    open, so a client is told to retry instead of refused); `exit_now()` (uvicorn's own shutdown) is called once
    no gated request is open and every answered one is recorded, or after `grace_s` (DSPINE_PROXY_GRACE)."""
    grace_s = GRACE_S if grace_s is None else grace_s
    DRAIN["since"] = time.monotonic()

    def wait():
        deadline = time.monotonic() + grace_s
        while (COUNTS["inflight"] or COUNTS["logged"] < COUNTS["answered"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        exit_now()

    threading.Thread(target=wait, name="dspine-drain", daemon=True).start()


def check_body(raw: bytes, content_type: str, kind: str, models: set[str]) -> tuple[int, dict]:
    """A request body (of a GATED kind) -> (200, the JSON document the proxy passes on) or (status, OpenAI error
    body)."""
    from dspine.serve.responses import to_chat

    try:
        doc = read_json(raw, content_type)
        body = to_chat(doc) if kind == "responses" else doc
        parse_request(body, kind != "completions", refuse_unsupported=False)  # the backend decides what it implements
        if not isinstance(doc.get("model"), str):
            raise RequestInvalid(f"'model' is required: one of {sorted(models)}", "model")
    except RequestInvalid as e:
        return 400, error_body(str(e), 400, e.param)
    if models and doc["model"] not in models:
        msg = f"model {doc['model']!r} does not exist; this proxy serves {sorted(models)}"
        return 404, error_body(msg, 404, "model", "model_not_found")
    return 200, doc


class RequestGate:
    """ASGI middleware: `RequestGate(app, models, key)` (key: the proxy's master key; None reads DSPINE_PROXY_KEY)."""

    def __init__(self, app, models: set[str] | None = None, key: str | None = None):
        self.app, self.models = app, set(models or ())
        self.key = key if key is not None else os.environ.get("DSPINE_PROXY_KEY", "")

    def _authenticated(self, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"").decode("latin-1")
        given = auth[7:] if auth.lower().startswith("bearer ") else headers.get(b"api-key", b"").decode("latin-1")
        return key_matches(given, self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, _draining_logs(receive), send)
        path = scope.get("path", "") if scope["type"] == "http" else ""
        kind = GATED.get(path)
        headers = dict(scope.get("headers") or [])
        if path.startswith(CLOSED) and not (path.startswith("/ui") and os.environ.get("DSPINE_PROXY_UI") == "1"):
            msg = f"{path} is not served by dspine proxy: use /v1/chat/completions, /v1/responses or /v1/completions"
            return await _answer(send, 404, error_body(msg, 404))
        if kind is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if not self._authenticated(headers):
            return await _answer(send, 401, error_body(KEY_REFUSED, 401, "api_key"))
        if DRAIN["since"] is not None:
            body = error_body("the proxy is shutting down; retry later", 503, None, "shutting_down")
            return await _answer(send, 503, body, [(b"retry-after", b"5")])
        COUNTS["inflight"] += 1
        try:
            await self._gated(scope, receive, send, kind, headers)
        finally:
            COUNTS["inflight"] -= 1

    async def _gated(self, scope, receive, send, kind: str, headers: dict) -> None:
        """A gated request from an authenticated client: read, checked, passed on (or answered here)."""
        try:
            raw = await asyncio.wait_for(_read(receive), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            msg = f"the request body did not arrive within {BODY_TIMEOUT_S:g} s"
            return await _answer(send, 408, error_body(msg, 408))
        if raw is None:  # the client went away
            return
        if len(raw) > MAX_BODY:
            return await _answer(send, 413, error_body(f"the request body is over {MAX_BODY} bytes", 413))
        ctype = headers.get(b"content-type", b"").decode("latin-1").lower()
        code, doc = check_body(raw, ctype, kind, self.models)
        if code != 200:
            return await _answer(send, code, doc)
        raw = json.dumps(doc).encode()  # as the server read it (a BOM or UTF-16 body too)
        fixed = {**headers, b"content-type": b"application/json", b"content-length": str(len(raw)).encode()}
        scope = {**scope, "headers": list(fixed.items())}
        status = []

        async def noting(msg):
            if msg["type"] == "http.response.start":
                status.append(msg["status"])
            await send(msg)

        if doc.get("stream"):  # a stream sees its client's disconnect itself (and LiteLLM records what was sent)
            await self.app(scope, _replay(raw, receive), noting)
        else:
            await _until_disconnect(self.app(scope, _replay(raw, None), noting), receive)
        if status and status[0] == 200:
            COUNTS["answered"] += 1  # the acceptance callback will record it (COUNTS["logged"])


def _draining_logs(receive, wait_s: float = 15.0):
    """The app's lifespan receive: at shutdown (after uvicorn has let open requests finish), first wait until the
    acceptance callback has recorded every request the gate saw answered (LiteLLM logs a finished stream from a
    task of its own, which the shutdown would otherwise cancel: the row lost), at most `wait_s`."""

    async def rcv():
        msg = await receive()
        if msg["type"] == "lifespan.shutdown":
            deadline = asyncio.get_running_loop().time() + wait_s
            while COUNTS["logged"] < COUNTS["answered"] and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
        return msg

    return rcv


def _replay(raw: bytes, receive):
    """The app's receive: the body once, then the client's messages (its disconnect) — or, with receive None (the
    gate watches the client itself: `_until_disconnect`), nothing more."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if receive is not None:
            return await receive()
        await asyncio.Event().wait()  # until cancelled with the app
        return {"type": "http.disconnect"}

    return replay


async def _until_disconnect(app_call, receive) -> None:
    """Run the app while watching the client: one that hangs up (or times out) before the answer is complete
    cancels the app, and with it LiteLLM's request to the backend, whose server aborts the decode at its next
    round (its record says abort) — instead of decoding to the end for no one."""
    app = asyncio.ensure_future(app_call)

    async def watch():
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    done, _ = await asyncio.wait({app, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if app in done:
        watcher.cancel()
        return app.result()
    app.cancel()
    try:
        await app
    except asyncio.CancelledError:
        pass


async def _read(receive) -> bytes | None:
    """The whole body (stopping once past MAX_BODY), or None when the client disconnects first."""
    raw, more = b"", True
    while more and len(raw) <= MAX_BODY:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        raw += msg.get("body", b"")
        more = msg.get("more_body", False)
    return raw


async def _answer(send, status: int, body: dict, extra: list | None = None) -> None:
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())] + (extra or [])
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})
