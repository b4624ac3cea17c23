"""The proxy's request gate: what LiteLLM's app sees only after dspine has checked it.

LiteLLM parses a request body leniently (a body it cannot read becomes `{}`, a form is read as fields) and
turns what its provider code trips over into 500s, so a malformed request through the proxy used to answer
"Missing required parameter 'messages'" or an internal error. The gate is a pure ASGI middleware in front of
LiteLLM's app for the OpenAI completion routes (chat, text and the Responses API): a POST without the master key
answers 401 (LiteLLM would parse the body first and could answer 500); one with it is read whole, parsed by the
server's own functions (protocol.read_json, responses.to_chat, protocol.parse_request) and, when bad, answered
with the same 4xx and message the server would give, before LiteLLM runs (fields a backend may or may not
implement, such as `logit_bias`, are left to the backend); an unknown model answers 404 as the server does. A good
body goes on unchanged, its Content-Type made application/json (a JSON body sent as a form by `curl -d` is still
JSON).
"""

from __future__ import annotations

import hmac
import json
import os

from dspine.serve.protocol import RequestInvalid, error_body, parse_request, read_json

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
MAX_BODY = 32 * 2**20


def key_matches(given: str | None, key: str | None = None) -> bool:
    """Constant-time comparison with the proxy's master key (None: DSPINE_PROXY_KEY); no key set: nothing matches."""
    key = key if key is not None else os.environ.get("DSPINE_PROXY_KEY", "")
    return bool(key) and hmac.compare_digest((given or "").encode(), key.encode())


def check_body(raw: bytes, content_type: str, kind: str, models: set[str]) -> tuple[int, dict] | None:
    """A request body (of a GATED kind) the proxy would pass on -> None, or (status, OpenAI error body)."""
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
    return None


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
        kind = GATED.get(scope.get("path", "")) if scope["type"] == "http" else None
        headers = dict(scope.get("headers") or [])
        if kind is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if not self._authenticated(headers):
            return await _answer(send, 401, error_body(KEY_REFUSED, 401, "api_key"))
        raw, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            raw += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(raw) > MAX_BODY:
                return await _answer(send, 413, error_body(f"the request body is over {MAX_BODY} bytes", 413))
        bad = check_body(raw, headers.get(b"content-type", b"").decode("latin-1").lower(), kind, self.models)
        if bad is not None:
            return await _answer(send, *bad)
        fixed = {**headers, b"content-type": b"application/json", b"content-length": str(len(raw)).encode()}
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # then the client's disconnect, as the app would see it

        await self.app({**scope, "headers": list(fixed.items())}, replay, send)


async def _answer(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})
