"""`dspine serve`: an OpenAI-compatible HTTP server over the embedded engine, answering in SGLang's shape.

Endpoints: /v1/chat/completions and /v1/completions (streaming and not), /v1/models, /health, /metrics
(Prometheus), and /v1/dspine/requests/{id} (the acceptance record of a finished request, the channel a proxy
callback reads for streamed requests, whose extra fields LiteLLM drops). Binds 127.0.0.1 by default.

Per-request acceptance comes back like SGLang 0.5.23: `sglext.spec_tokens_details` when the request sets
`return_spec_tokens_details`, `meta_info` when it sets `return_meta_info` (fields from stats.AcceptanceStats).
`reasoning_effort` (none/low/medium/high/xhigh) is mapped onto the target (Qwen3: `enable_thinking`; others: a
system instruction with a reasoning-token budget) and echoed in the record. One decoding thread (`Batcher`)
decodes the requests waiting for it together (up to --max-batch); a streaming client that disconnects aborts
its own row at the next token.
"""


import asyncio
import json
import queue
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

from dspine.engine import Engine, generate_batch
from dspine.process import free_port, wait_http
from dspine.sampling import RequestError, SamplingParams

EFFORTS = ("none", "low", "medium", "high", "xhigh")
REASONING_BUDGET = {"low": 256, "medium": 1024, "high": 4096, "xhigh": 8192}


@dataclass
class ServeConfig:
    model_name: str = "dspine"
    max_prompt_tokens: int | None = None  # default: the target's context - 1
    max_records: int = 10000
    max_batch: int = 8  # requests decoded together (those waiting when a batch starts; greedy or unseeded)


def apply_reasoning_effort(model_type: str, messages: list[dict], effort: str) -> tuple[list[dict], dict]:
    """-> (messages, chat-template kwargs) for the target's notion of thinking."""
    if model_type.startswith("qwen3"):
        return messages, {"enable_thinking": effort != "none"}
    if effort == "none":
        return messages, {}
    note = (f"Reasoning effort: {effort}. Think step by step before answering, using at most "
            f"{REASONING_BUDGET[effort]} tokens of reasoning, then give the answer.")
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}] + messages[1:], {}
    return [{"role": "system", "content": note}] + messages, {}


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _num(body: dict, key: str, kind, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and int(v) != v):
        raise BadRequest(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be in [{lo}, {hi}], got {v!r}", param=key)
    return kind(v)


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = ("workload", "thinking", "method")
        self.requests = Counter("dspine_requests", "finished requests", labels, registry=self.registry)
        self.errors = Counter("dspine_request_errors", "refused requests", ("code",), registry=self.registry)
        self.tokens = Counter("dspine_completion_tokens", "generated tokens", labels, registry=self.registry)
        self.rounds = Counter("dspine_verify_rounds", "target verify rounds", labels, registry=self.registry)
        self.accepted = Counter("dspine_accepted_drafts", "accepted draft tokens", labels, registry=self.registry)
        self.accept_len = Histogram("dspine_accept_length", "per-request acceptance length τ", labels,
                                    buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16), registry=self.registry)
        self.latency = Histogram("dspine_request_seconds", "request latency", labels, registry=self.registry)
        self.inflight = Gauge("dspine_inflight_requests", "requests being served", registry=self.registry)

    def observe(self, rec: dict) -> None:
        lab = (rec["workload"], rec["thinking"], rec["method"])
        self.requests.labels(*lab).inc()
        self.tokens.labels(*lab).inc(rec["completion_tokens"])
        self.latency.labels(*lab).observe(rec["latency_s"])
        if rec.get("spec"):
            self.rounds.labels(*lab).inc(rec["spec"]["spec_verify_ct"])
            self.accepted.labels(*lab).inc(rec["spec"]["spec_num_correct_drafts"])
            self.accept_len.labels(*lab).observe(rec["spec"]["spec_accept_length"])


class Batcher:
    """One decoding thread for the engine. Requests waiting when it starts a batch are decoded together
    (engine.generate_batch) when they draw tokens alike (same temperature / top-k / top-p) and are greedy
    or unseeded; a seeded sampled request runs alone, so its seed reproduces its output. A static batch:
    what arrives meanwhile waits for the next one."""

    def __init__(self, engine: Engine, max_batch: int):
        self.engine, self.max_batch = engine, max(1, max_batch)
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="dspine-batcher").start()

    def submit(self, ids: list[int], params, on_token=None):
        """Blocks until the request is decoded -> GenerationResult (raises what decoding raised)."""
        self.engine.prompt_ids(ids)  # a bad prompt fails alone, before it joins a batch
        fut: Future = Future()
        self.jobs.put((ids, params, on_token, fut))
        return fut.result()

    @staticmethod
    def _key(params):
        return None if params.seed is not None and not params.greedy else \
            (params.temperature, params.top_k, params.top_p)

    def _loop(self):
        held = None
        while True:
            first = held or self.jobs.get()
            held, batch = None, [first]
            key = self._key(first[1])
            while key is not None and len(batch) < self.max_batch:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if self._key(job[1]) != key:
                    held = job  # starts the next batch
                    break
                batch.append(job)
            try:
                if len(batch) == 1:
                    ids, params, cb, _ = batch[0]
                    results = [self.engine.generate(ids, params, on_token=cb)]
                else:
                    results = generate_batch(self.engine, [j[0] for j in batch], [j[1] for j in batch],
                                             [j[2] for j in batch])
                for job, res in zip(batch, results):
                    job[3].set_result(res)
            except Exception as e:  # noqa: BLE001 — every waiting request hears of it
                for job in batch:
                    job[3].set_exception(e)


class Service:
    """Request parsing, generation and records, independent of the HTTP framework."""

    def __init__(self, engine: Engine, cfg: ServeConfig | None = None, drafter_name: str | None = None):
        self.engine, self.cfg = engine, cfg or ServeConfig()
        self.drafter_name = drafter_name or (engine.method if engine.drafter is not None else None)
        self.batcher = Batcher(engine, self.cfg.max_batch)
        self.records: OrderedDict[str, dict] = OrderedDict()
        self.metrics = Metrics()
        tgt = engine.target
        self.max_prompt = self.cfg.max_prompt_tokens or tgt.info.max_position_embeddings - 1

    # ---- parsing ---------------------------------------------------------------------------------------
    def parse(self, body, chat: bool) -> dict:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.cfg.model_name:
            raise BadRequest(f"model {model!r} does not exist; this server serves {self.cfg.model_name!r}",
                             status=404, param="model", code="model_not_found")
        effort = body.get("reasoning_effort") or "none"
        if effort not in EFFORTS:
            raise BadRequest(f"'reasoning_effort' must be one of {list(EFFORTS)}, got {effort!r}",
                             param="reasoning_effort")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("'messages' is required: a non-empty list of {role, content}", param="messages")
            for m in msgs:
                if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") \
                        or not isinstance(m.get("content", ""), str):
                    raise BadRequest("each message needs a role (system/user/assistant/tool) and string content",
                                     param="messages")
            msgs, kw = apply_reasoning_effort(self.engine.target.info.model_type,
                                              [{"role": m["role"], "content": m.get("content", "")} for m in msgs],
                                              effort)
            try:
                ids = self.engine.target.chat_ids(msgs, **kw)
            except Exception as e:  # a chat template that rejects these messages
                raise BadRequest(f"cannot apply the chat template: {e}", param="messages") from None
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise BadRequest("'prompt' is required: a non-empty string", param="prompt")
            ids = self.engine.target.encode(prompt)
        if not ids:
            raise BadRequest("the prompt is empty", param="messages" if chat else "prompt")
        if len(ids) > self.max_prompt:
            raise BadRequest(f"the prompt has {len(ids)} tokens; at most {self.max_prompt} are accepted",
                             param="messages" if chat else "prompt", code="context_length_exceeded")
        max_tokens = _num(body, "max_completion_tokens", int, None, lo=1) if "max_completion_tokens" in body \
            else _num(body, "max_tokens", int, 256, lo=1)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("'stop' must be a string or a list of non-empty strings", param="stop")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("'seed' must be an integer", param="seed")
        params = SamplingParams(max_tokens=max_tokens, temperature=_num(body, "temperature", float, 1.0, 0, 2),
                                top_p=_num(body, "top_p", float, 1.0, 0, 1), top_k=_num(body, "top_k", int, 0, 0),
                                stop=stop, seed=seed)
        if params.top_p == 0:
            raise BadRequest("'top_p' must be greater than 0", param="top_p")
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            raise BadRequest("'metadata' must be an object", param="metadata")
        return {"ids": ids, "params": params, "effort": effort, "stream": bool(body.get("stream", False)),
                "workload": str(meta.get("workload", "default")), "metadata": meta,
                "details": bool(body.get("return_spec_tokens_details")), "meta_info": bool(body.get("return_meta_info"))}

    # ---- generation ------------------------------------------------------------------------------------
    def run(self, req: dict, on_token=None) -> dict:
        rid = req.setdefault("id", f"chatcmpl-{uuid.uuid4().hex[:24]}")
        t0 = time.time()
        self.metrics.inflight.inc()
        try:
            res = self.batcher.submit(req["ids"], req["params"], on_token)
        except RequestError as e:
            raise BadRequest(str(e)) from None
        finally:
            self.metrics.inflight.dec()
        rec = {"id": rid, "model": self.cfg.model_name, "drafter": self.drafter_name, "method": res.method,
               "workload": req["workload"], "thinking": req["effort"], "prompt_tokens": res.prompt_tokens,
               "completion_tokens": res.completion_tokens, "finish_reason": res.finish_reason,
               "latency_s": time.time() - t0, "created": int(t0), "text": res.text, "batch_size": res.batch_size,
               "spec": res.stats.sglang_meta() if res.stats is not None else None}
        self.records[rid] = rec
        while len(self.records) > self.cfg.max_records:
            self.records.popitem(last=False)
        self.metrics.observe(rec)
        return rec

    def extras(self, req: dict, rec: dict) -> dict:
        out = {}
        spec = rec["spec"] or {"spec_accept_length": 1.0, "spec_verify_ct": 0}
        if req["details"]:
            out["sglext"] = {"spec_tokens_details": spec, "reasoning_effort": rec["thinking"]}
        if req["meta_info"]:
            out["meta_info"] = {**spec, "id": rec["id"], "prompt_tokens": rec["prompt_tokens"],
                                "completion_tokens": rec["completion_tokens"], "reasoning_effort": rec["thinking"]}
        return out

    def response(self, req: dict, rec: dict, chat: bool) -> dict:
        usage = {"prompt_tokens": rec["prompt_tokens"], "completion_tokens": rec["completion_tokens"],
                 "total_tokens": rec["prompt_tokens"] + rec["completion_tokens"]}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": rec["text"]},
                      "finish_reason": rec["finish_reason"]}
        else:
            choice = {"index": 0, "text": rec["text"], "finish_reason": rec["finish_reason"]}
        return {"id": rec["id"], "object": "chat.completion" if chat else "text_completion", "created": rec["created"],
                "model": rec["model"], "choices": [choice], "usage": usage, **self.extras(req, rec)}


def create_app(service: Service):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(title="dspine", docs_url=None, redoc_url=None)

    def error(e: BadRequest) -> JSONResponse:
        service.metrics.errors.labels(str(e.status)).inc()
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}},
                            status_code=e.status)

    async def body_of(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None

    async def complete(request: Request, chat: bool):
        try:
            req = service.parse(await body_of(request), chat)
        except BadRequest as e:
            return error(e)
        if not req["stream"]:
            try:
                rec = await asyncio.to_thread(service.run, req)
            except BadRequest as e:
                return error(e)
            return JSONResponse(service.response(req, rec, chat), headers={"x-dspine-request-id": rec["id"]})
        return StreamingResponse(stream(request, req, chat), media_type="text/event-stream",
                                 headers={"x-dspine-request-id": req.setdefault("id", f"chatcmpl-{uuid.uuid4().hex[:24]}")})

    async def stream(request: Request, req: dict, chat: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()
        tokens: list[int] = []
        tgt = service.engine.target
        hold = max((len(s) for s in req["params"].stop), default=1) - 1

        def on_token(tok: int):
            tokens.append(tok)
            loop.call_soon_threadsafe(queue.put_nowait, ("tok", None))
            return not gone.is_set()

        def work():
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ("done", service.run(req, on_token)))
            except BadRequest as e:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

        task = loop.run_in_executor(None, work)
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(delta_text: str | None, finish=None, extra=None) -> str:
            if chat:
                delta = {"role": "assistant", "content": delta_text} if delta_text is not None else {}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish}
            return "data: " + json.dumps({"id": req["id"], "object": obj, "created": created,
                                          "model": service.cfg.model_name, "choices": [choice], **(extra or {})}) + "\n\n"

        sent = ""
        try:
            while True:
                kind, payload = await queue.get()
                if kind == "tok":
                    text = tgt.decode(tokens)
                    safe = text[: len(text) - hold] if hold else text
                    if safe.endswith("\ufffd"):
                        continue  # an incomplete UTF-8 sequence: wait for the next token
                    if len(safe) > len(sent):
                        yield chunk(safe[len(sent):])
                        sent = safe
                    if await request.is_disconnected():
                        gone.set()
                elif kind == "error":
                    yield "data: " + json.dumps({"error": {"message": str(payload), "type": "invalid_request_error"}}) + "\n\n"
                    break
                else:
                    rec = payload
                    if len(rec["text"]) > len(sent) and rec["text"].startswith(sent):
                        yield chunk(rec["text"][len(sent):])
                    usage = {"prompt_tokens": rec["prompt_tokens"], "completion_tokens": rec["completion_tokens"],
                             "total_tokens": rec["prompt_tokens"] + rec["completion_tokens"]}
                    yield chunk(None, rec["finish_reason"], {"usage": usage, **service.extras(req, rec)})
                    yield "data: [DONE]\n\n"
                    break
        finally:
            gone.set()
            await task  # the engine stops at its next token once `gone` is set

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.cfg.model_name, "object": "model", "owned_by": "dspine",
                                            "drafter": service.drafter_name, "method": service.engine.method}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/dspine/requests/{rid}")
    async def record(rid: str):
        rec = service.records.get(rid)
        if rec is None:
            return error(BadRequest(f"no finished request {rid!r}", status=404))
        return rec

    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, cfg: ServeConfig | None = None,
          drafter_name: str | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(Service(engine, cfg, drafter_name)), host=host, port=port, log_level="warning")


def start_server_process(drafter: str | None = None, name: str = "dspine", target: str | None = None,
                         port: int | None = None, extra: list[str] | None = None, log=None):
    """`dspine serve` as a child process on 127.0.0.1 -> (process, base URL), once /health answers."""
    import subprocess
    import sys

    port = port or free_port()
    cmd = [sys.executable, "-m", "dspine.cli", "serve", "--port", str(port), "--served-model-name", name]
    cmd += (["--drafter", str(drafter)] if drafter else []) + (["--target", target] if target else []) + (extra or [])
    proc = subprocess.Popen(cmd, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", proc, 240)
    return proc, base
