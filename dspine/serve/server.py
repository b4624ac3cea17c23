"""`dspine serve`: an OpenAI-compatible HTTP server over the embedded engine, answering in SGLang's shape.

Endpoints: /v1/chat/completions and /v1/completions (streaming and not), /v1/models, /health, /metrics
(Prometheus), and /v1/dspine/requests/{id} (the acceptance record of a finished request, the channel a proxy
callback reads for streamed requests, whose extra fields LiteLLM drops). Binds 127.0.0.1 by default.

Per-request acceptance comes back like SGLang 0.5.23: `sglext.spec_tokens_details` when the request sets
`return_spec_tokens_details`, `meta_info` when it sets `return_meta_info` (fields from stats.AcceptanceStats).
`reasoning_effort` (none/low/medium/high/xhigh) is mapped onto the target (Qwen3: `enable_thinking`; others: a
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
import hashlib
import json
import queue
import sys
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from dspine.engine import BatchDecode, Engine
from dspine.process import free_port, wait_http
from dspine.sampling import RequestError, SamplingParams
from dspine.serve.metrics import AcceptanceMetrics
from dspine.serve.protocol import (
    ROUTE,
    ROUTE_FORM,
    AssistantMessage,
    ChatChoice,
    ChatRequest,
    Completion,
    Delta,
    DeltaChoice,
    RequestInvalid,
    TextChoice,
    Usage,
    error_body,
    logprobs_doc,
    parse_request,
    parse_tool_calls,
    route_of_request,
    streamable_prefix,
    template_has_tools,
    template_messages,
)
from dspine.serve.protocol import read_json as protocol_read_json
from dspine.serve.records import RequestRecord

REASONING_BUDGET = {"low": 256, "medium": 1024, "high": 4096, "xhigh": 8192}


@dataclass
class Route:
    """A drafter serving the requests of one workload (and thinking level) beside the default one."""

    engine: Engine
    label: str | None
    path: str | None

    def info(self) -> dict:
        return {"drafter": self.label, "path": self.path, "method": self.engine.method}


def drafter_label(path: str) -> str:
    """How records, /v1/models and swaps name a drafter folder: its last two path parts (never an absolute path)."""
    from pathlib import Path

    return "/".join(Path(path).resolve().parts[-2:])


@dataclass
class ServeConfig:
    model_name: str = "dspine"
    max_prompt_tokens: int | None = None  # default: the target's context - 1
    max_records: int = 10000
    max_batch: int = 8  # requests decoded together (those waiting when a batch starts; greedy or unseeded)
    max_queue: int = 64  # requests admitted at once (decoding + waiting); more get 429 with Retry-After
    grace_s: float = 30.0  # on SIGTERM: in-flight requests may finish this long, then are aborted
    stall_s: float = 300.0  # /health reports the decode loop dead when a batch makes no progress this long
    admin_key: str | None = None  # bearer key of POST /v1/dspine/drafter (the drafter swap); None: swap disabled
    request_timeout_s: float | None = None  # a request decoding longer is aborted (its own `timeout` may ask less)
    draft_dtype: str | None = None  # drafters swapped in decode in it (checkpoint.draft_dtype; None: the target's)


def thinking_mode(model_type: str) -> dict:
    """How `reasoning_effort` reaches this target, as /v1/models reports it and `dspine serve` says at start."""
    if model_type.startswith("qwen3"):
        return {"mode": "enable_thinking", "detail": "none: enable_thinking=False; any other level: True"}
    budget = ", ".join(f"{k} {v}" for k, v in REASONING_BUDGET.items())
    return {"mode": "system_note", "detail": "the target has no thinking mode: low..xhigh add a system note asking "
            f"for step-by-step reasoning within a token budget ({budget}); none adds nothing"}  # fmt: skip


def apply_reasoning_effort(model_type: str, messages: list[dict], effort: str) -> tuple[list[dict], dict]:
    """-> (messages, chat-template kwargs) for the target's notion of thinking (see thinking_mode)."""
    if thinking_mode(model_type)["mode"] == "enable_thinking":
        return messages, {"enable_thinking": effort != "none"}
    if effort == "none":
        return messages, {}
    note = (
        f"Reasoning effort: {effort}. Think step by step before answering, using at most "
        f"{REASONING_BUDGET[effort]} tokens of reasoning, then give the answer."
    )
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}] + messages[1:], {}
    return [{"role": "system", "content": note}] + messages, {}


@dataclass
class Parsed:
    """A checked request, ready for the engine."""

    ids: list[int]
    params: SamplingParams
    effort: str
    stream: bool
    workload: str
    details: bool
    meta_info: bool
    token_ids: bool
    tool_names: set[str] | None  # the offered functions; None: no tools, the reply is plain content
    one_call: bool = False  # parallel_tool_calls false: at most one tool call per reply
    n: int = 1  # choices
    timeout_s: float | None = None  # decoding longer than this aborts the request
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after


class ServerMetrics:
    """The acceptance families (serve.metrics) by workload × thinking × method, plus refusals and in-flight."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.acceptance = AcceptanceMetrics("dspine", ("workload", "thinking", "method"), self.registry)
        self.errors = Counter("dspine_request_errors", "refused requests", ("code",), registry=self.registry)
        self.inflight = Gauge("dspine_inflight_requests", "requests being served", registry=self.registry)


class Batcher:
    """One decoding thread for the engine, scheduling at round boundaries (continuous batching). Requests that
    arrive are prefilled as a batch of their own (engine.BatchDecode), then join a running batch that draws
    tokens alike (same temperature / top-k / top-p, greedy or unseeded; a seeded sampled request keeps its own
    batch so its seed reproduces its output) when the rows fit (≤ max_batch) and the two caches are of a
    like width (a short row beside a long one would pay for the long one's attention); otherwise it runs
    beside them, and batches take one round each in turn. A row leaves its batch the round it finishes, its
    result handed back at once; batches that shrink merge again. A row whose client went away (on_token ->
    False) stops at its next round. `use` swaps the engine (another drafter): rows already decoding finish on
    the engine they started with (batches of different engines never merge); rows submitted with a route
    decode on its engine, in batches of their own; each result names the drafter that decoded it
    (`result.drafter`)."""

    def __init__(self, engine: Engine, max_batch: int, label: str | None = None):
        self.engine, self.max_batch, self.label = engine, max(1, max_batch), label
        self.jobs: queue.Queue = queue.Queue()
        self.decoding = False
        self.last_progress = time.monotonic()  # the last round run, or the loop idle
        self.thread = threading.Thread(target=self._loop, daemon=True, name="dspine-batcher")
        self.thread.start()

    def submit(self, rows: list[tuple], route: Route | None = None) -> list:
        """rows: [(prompt ids, SamplingParams, on_token)], decoded by `route`'s engine (None: the default engine
        when their batch starts); blocks until all are decoded -> [GenerationResult] (raises what decoding
        raised)."""
        for ids, _, _ in rows:
            (route.engine if route else self.engine).prompt_ids(ids)  # a bad prompt fails alone, before it joins
        futs = []
        for ids, params, on_token in rows:
            futs.append(Future())
            self.jobs.put((ids, params, on_token or (lambda tok: True), futs[-1], route))
        return [f.result() for f in futs]

    def use(self, engine: Engine, label: str | None) -> None:
        self.engine, self.label = engine, label  # read together by the loop at the next batch start

    @staticmethod
    def _key(params):
        return (
            None if params.seed is not None and not params.greedy else (params.temperature, params.top_k, params.top_p)
        )

    def _groups(self, jobs: list) -> list[list]:
        """Arrival order kept within each group; at most max_batch rows per group; seeded sampling alone."""
        groups: list[list] = []
        open_: dict = {}
        for job in jobs:
            key = self._key(job[1])
            key = None if key is None else (id(job[4]), key)  # a routed drafter's rows batch apart
            g = open_.get(key) if key is not None else None
            if g is None or len(g) >= self.max_batch:
                g = []
                groups.append(g)
                if key is not None:
                    open_[key] = g
            g.append(job)
        return groups

    def _take(self, block: bool) -> list:
        jobs = [self.jobs.get()] if block else []
        while True:
            try:
                jobs.append(self.jobs.get_nowait())
            except queue.Empty:
                return jobs

    def _start(self, group: list):
        route = group[0][4]
        engine, label = (route.engine, route.label) if route is not None else (self.engine, self.label)
        try:
            run = BatchDecode(engine, [j[0] for j in group], [j[1] for j in group], [j[2] for j in group], group)
            run.label = label
            return run
        except Exception as e:
            for job in group:
                job[3].set_exception(e)
            return None

    def _fits(self, a: BatchDecode, b: BatchDecode) -> bool:
        return (
            a.can_merge(b)
            and self._key(a.params) is not None
            and len(a) + len(b) <= self.max_batch
            and max(a.width, b.width) <= 2 * min(a.width, b.width) + 256
        )

    @staticmethod
    def _settle(run: BatchDecode) -> None:
        for job, res in run.pop_finished():
            res.drafter = run.label
            job[3].set_result(res)

    def _place(self, running: list, run: BatchDecode) -> None:
        """A batch with rows left joins the first running batch it fits, or runs beside them."""
        if not len(run):
            return
        host = next((r for r in running if r is not run and self._fits(r, run)), None)
        if host is None:
            if run not in running:
                running.append(run)
            return
        host.merge(run)
        if run in running:
            running.remove(run)

    def _loop(self):
        running: list[BatchDecode] = []
        while True:
            self.decoding = bool(running)
            self.last_progress = time.monotonic()
            for group in self._groups(self._take(block=not running)):
                run = self._start(group)
                if run is not None:
                    self._settle(run)  # rows that end at their first token
                    self._place(running, run)
            self.decoding = True
            for run in list(running):
                try:
                    run.step()
                    self._settle(run)
                except Exception as e:
                    for job in run.tags:
                        job[3].set_exception(e)
                    running.remove(run)
                    continue
                self.last_progress = time.monotonic()
                if not len(run):
                    running.remove(run)
                elif len(run) < self.max_batch:
                    self._place(running, run)


class Service:
    """Request parsing, generation and records, independent of the HTTP framework."""

    def __init__(self, engine: Engine, cfg: ServeConfig | None = None, drafter_name: str | None = None):
        self.engine, self.cfg = engine, cfg or ServeConfig()
        self.drafter_name = drafter_name or (engine.method if engine.drafter is not None else None)
        self.drafter_path: str | None = None  # the folder served (what a rollback swaps back to)
        self.swaps: list[dict] = []
        self.routes: dict[str, Route] = {}  # "tool" / "tool/high" -> a drafter beside the default one
        self.batcher = Batcher(engine, self.cfg.max_batch, self.drafter_name)
        self.records: OrderedDict[str, RequestRecord] = OrderedDict()
        self.metrics = ServerMetrics()
        self.admitted = 0
        self.lock = threading.Lock()
        self.stopping = False
        self.abort_all = threading.Event()  # set when the shutdown grace period is over
        tgt = engine.target
        self.max_prompt = self.cfg.max_prompt_tokens or tgt.info.max_position_embeddings - 1
        template = getattr(tgt.tokenizer, "chat_template", None)
        self.template_sha256 = hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None

    # ---- parsing ---------------------------------------------------------------------------------------
    def parse(self, body, chat: bool) -> Parsed:
        try:
            req = parse_request(body, chat)
        except RequestInvalid as e:
            raise BadRequest(str(e), param=e.param) from None
        if req.model is not None and req.model != self.cfg.model_name:
            raise BadRequest(
                f"model {req.model!r} does not exist; this server serves {self.cfg.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        effort = req.reasoning_effort or "none"
        tools: list = []
        if chat:
            tools = req.active_tools()
            ids = self._chat_ids(req, effort)
        else:
            ids = self.engine.target.encode(req.prompt)
        where = "messages" if chat else "prompt"
        if not ids:
            raise BadRequest("the prompt is empty", param=where)
        if len(ids) > self.max_prompt:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens; at most {self.max_prompt} are accepted",
                param=where,
                code="context_length_exceeded",
            )
        room = self.engine.target.info.max_position_embeddings - len(ids)  # the context window left
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is not None and max_tokens > room:  # refused, as OpenAI does, rather than clamped
            key = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            raise BadRequest(f"'{key}' is {max_tokens}, but the prompt's {len(ids)} tokens leave room for at most "
                             f"{room} in the context window", param=key, code="context_length_exceeded")  # fmt: skip
        max_tokens = max_tokens or min(256, room)
        stop = ([req.stop] if req.stop else []) if isinstance(req.stop, str) else list(req.stop or [])
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            stop=stop,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=req.top_k_logprobs(),
        )
        meta = req.metadata or {}
        return Parsed(
            ids=ids,
            params=params,
            effort=effort,
            stream=req.stream,
            workload=str(meta.get("workload", "default")),
            details=req.return_spec_tokens_details,
            meta_info=req.return_meta_info,
            token_ids=req.return_token_ids,
            tool_names={t.function.name for t in tools} if tools else None,
            one_call=chat and req.parallel_tool_calls is False,
            n=req.n,
            timeout_s=min((t for t in (req.timeout, self.cfg.request_timeout_s) if t), default=None),
        )

    def _chat_ids(self, req: ChatRequest, effort: str) -> list[int]:
        tgt = self.engine.target
        native = template_has_tools(getattr(tgt.tokenizer, "chat_template", None))
        msgs, kw = template_messages(req, native)
        msgs, kw2 = apply_reasoning_effort(tgt.info.model_type, msgs, effort)
        try:
            return tgt.chat_ids(msgs, **kw, **kw2)
        except Exception as e:  # a chat template that rejects these messages
            raise BadRequest(f"cannot apply the chat template: {e}", param="messages") from None

    # ---- admission, health, shutdown --------------------------------------------------------------------
    def admit(self) -> None:
        """Take a place for one request, or refuse it: 503 while shutting down, 429 when the queue is full."""
        with self.lock:
            if self.stopping:
                raise BadRequest("the server is shutting down", status=503, code="shutting_down", retry_after=5)
            if self.admitted >= self.cfg.max_queue:
                raise BadRequest(f"the server is busy ({self.admitted} requests admitted, at most "
                                 f"{self.cfg.max_queue}); retry later", status=429, code="queue_full",
                                 retry_after=1)  # fmt: skip
            self.admitted += 1

    def release(self) -> None:
        with self.lock:
            self.admitted -= 1

    def health(self) -> dict:
        """Liveness (the decode loop runs and, while decoding, makes progress) and readiness (it would admit a
        request now), reported apart."""
        b = self.batcher
        age = time.monotonic() - b.last_progress
        live = b.thread.is_alive() and not (b.decoding and age > self.cfg.stall_s)
        ready = live and not self.stopping and self.admitted < self.cfg.max_queue
        return {"status": "stopping" if self.stopping else ("ok" if live else "stalled"), "live": live,
                "ready": ready, "admitted": self.admitted, "max_queue": self.cfg.max_queue,
                "decoding": b.decoding, "last_progress_age_s": round(age, 3)}  # fmt: skip

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop admitting; in-flight requests may finish for grace_s, then every row aborts at its next token."""
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
        timer = threading.Timer(grace_s, self.abort_all.set)
        timer.daemon = True
        timer.start()

    def swap_drafter(self, path: str, name: str | None = None, route: str | None = None, remove: bool = False) -> dict:
        """Serve another drafter ("none": AR): loaded and checked against the target first (a wrong or broken
        checkpoint raises CheckpointError and the current one keeps serving); batches already decoding
        finish on the old drafter, new ones start on the new -> {"previous", "current"} (and "route"). With a
        `route` (WORKLOAD or WORKLOAD/LEVEL) only that workload's requests change drafter; `remove` sends them
        back to the default one."""
        if route is not None:
            return self._swap_route(route, path, name, remove)
        engine, label = self._engine_for(path, name)
        with self.lock:
            previous = {"drafter": self.drafter_name, "path": self.drafter_path, "method": self.engine.method}
            self.engine, self.drafter_name, self.drafter_path = engine, label, None if engine.drafter is None else path
            self.batcher.use(engine, label)
            current = {"drafter": label, "path": self.drafter_path, "method": engine.method}
            self.swaps.append({"ts": time.time(), "previous": previous, "current": current})
        return {"previous": previous, "current": current}

    def _engine_for(self, path: str, name: str | None) -> tuple[Engine, str | None]:
        from dspine.checkpoint import draft_dtype, load_drafter

        tgt = self.engine.target
        dtype = draft_dtype(self.cfg.draft_dtype, tgt.dtype, tgt.device)
        drafter = None if path == "none" else load_drafter(path, tgt, dtype=dtype, device=tgt.device)
        cur = self.engine  # its decode-time choices carry over where the new drafter's block allows them
        B = drafter.config.block_size if drafter is not None else 1
        keep = cur.draft_len if drafter is not None and cur.drafter is not None and cur.draft_len <= B - 1 else None
        chosen = cur.drafter is not None and cur.draft_block < cur.drafter.config.block_size  # not the whole block
        block = cur.draft_block if keep is not None and chosen and cur.draft_block <= B else None
        tree = cur.tree if keep is not None and cur.tree is not None and cur.tree.fits(drafter.config) else None
        engine = Engine(tgt, drafter, keep, block, cur.spec_max_batch, tree, goodput=cur.policy is not None)
        return engine, None if drafter is None else (name or drafter_label(path))

    def _swap_route(self, route: str, path: str, name: str | None, remove: bool) -> dict:
        if not ROUTE.fullmatch(route):
            raise ValueError(f"route {route!r}: {ROUTE_FORM}")
        new = None
        if not remove:
            engine, label = self._engine_for(path, name)
            new = Route(engine, label, None if engine.drafter is None else path)
        with self.lock:
            old = self.routes.get(route)
            if new is None:
                self.routes.pop(route, None)
            else:
                self.routes[route] = new
            previous, current = (r.info() if r else None for r in (old, new))
            self.swaps.append({"ts": time.time(), "route": route, "previous": previous, "current": current})
        return {"route": route, "previous": previous, "current": current}

    def route_for(self, req: Parsed) -> Route | None:
        """The most specific route of the request's workload and thinking level; None: the default drafter."""
        with self.lock:
            return route_of_request(self.routes, req.workload, req.effort)

    def drafters(self) -> dict:
        """GET /v1/dspine/drafter: the default drafter, the routes, the latest swaps."""
        with self.lock:
            routes = {k: r.info() for k, r in sorted(self.routes.items())}
            return {"drafter": self.drafter_name, "path": self.drafter_path, "method": self.engine.method,
                    "routes": routes, "swaps": self.swaps[-20:]}  # fmt: skip

    # ---- generation ------------------------------------------------------------------------------------
    def run(self, req: Parsed, on_token=None, gone: threading.Event | None = None) -> tuple[RequestRecord, list]:
        """Decode one request's `n` choices -> (its record, one GenerationResult per choice). A choice aborts at
        its next token once `gone` is set (the client left), its time limit has passed or the shutdown grace period
        is over; `on_token(choice, token)` returning False aborts that choice too. Choice i of a seeded request
        draws from seed + i."""
        t0 = time.time()
        until = t0 + req.timeout_s if req.timeout_s else float("inf")

        def cb(i):
            def f(tok):
                if self.abort_all.is_set() or (gone is not None and gone.is_set()) or time.time() > until:
                    return False
                return on_token(i, tok) if on_token is not None else True

            return f

        seeds = [req.params.seed + i if req.params.seed is not None else None for i in range(req.n)]
        rows = [(req.ids, replace(req.params, seed=seeds[i]), cb(i)) for i in range(req.n)]
        self.metrics.inflight.inc()
        try:
            results = self.batcher.submit(rows, self.route_for(req))
        except RequestError as e:
            raise BadRequest(str(e)) from None
        finally:
            self.metrics.inflight.dec()
        res = results[0]
        stats = [r.stats for r in results if r.stats is not None]
        hist = [sum(col) for col in zip(*(s.accept_hist for s in stats))] if stats else None
        rec = RequestRecord(
            request_id=req.id,
            model=self.cfg.model_name,
            drafter=getattr(res, "drafter", self.drafter_name),  # the drafter that decoded it (swaps)
            method=res.method,
            workload=req.workload,
            thinking=req.effort,
            stream=req.stream,
            prompt_tokens=res.prompt_tokens,
            completion_tokens=sum(r.completion_tokens for r in results),
            finish_reason=res.finish_reason,
            latency_s=time.time() - t0,
            ts=t0,
            accept_hist=hist,
            source="engine" if hist is not None else None,
            batch_size=max(r.batch_size for r in results),
            text=res.text,
            prompt_token_ids=list(req.ids) if req.token_ids else None,
            completion_token_ids=list(res.token_ids) if req.token_ids else None,
        )
        self.records[rec.request_id] = rec
        while len(self.records) > self.cfg.max_records:
            self.records.popitem(last=False)
        self.metrics.acceptance.observe(rec)
        return rec, results

    def extras(self, req: Parsed, rec: RequestRecord) -> dict:
        out = {}
        spec = rec.spec() or {"spec_accept_length": 1.0, "spec_verify_ct": 0}
        if req.details:
            out["sglext"] = {"spec_tokens_details": spec, "reasoning_effort": rec.thinking}
        if req.meta_info:
            out["meta_info"] = {
                **spec,
                "id": rec.request_id,
                "prompt_tokens": rec.prompt_tokens,
                "completion_tokens": rec.completion_tokens,
                "reasoning_effort": rec.thinking,
            }
        if req.token_ids:
            out["prompt_token_ids"] = rec.prompt_token_ids
        return out

    def choice_extras(self, req: Parsed, res, chat: bool) -> dict:
        """A choice's token ids (return_token_ids) and logprobs (when asked), from its GenerationResult."""
        out = {"token_ids": list(res.token_ids)} if req.token_ids else {}
        if res.logprobs is not None:
            decode = lambda t: self.engine.target.decode([t])
            out["logprobs"] = logprobs_doc(list(zip(res.token_ids, res.logprobs)), decode, chat)
        return out

    def reply(self, req: Parsed, text: str, finish_reason: str) -> tuple[str | None, list[dict], str]:
        """(content, tool_calls, finish_reason) of a finished generation."""
        if req.tool_names is None:
            return text, [], finish_reason
        content, calls = parse_tool_calls(text, req.tool_names)
        return (content, calls[:1] if req.one_call else calls, "tool_calls") if calls else (text, [], finish_reason)

    def response(self, req: Parsed, rec: RequestRecord, results: list, chat: bool) -> dict:
        choices = []
        for i, res in enumerate(results):
            extra = self.choice_extras(req, res, chat)
            if chat:
                content, calls, finish = self.reply(req, res.text, res.finish_reason)
                message = AssistantMessage(
                    role="assistant", content=content, **({"tool_calls": calls} if calls else {})
                )
                choices.append(ChatChoice(index=i, message=message, finish_reason=finish, **extra))
            else:
                choices.append(TextChoice(index=i, text=res.text, finish_reason=res.finish_reason, **extra))
        return Completion(id=rec.request_id, object="chat.completion" if chat else "text_completion",
                          created=int(rec.ts), model=rec.model, choices=choices, usage=usage(rec),
                          **self.extras(req, rec)).dump()  # fmt: skip


def usage(rec: RequestRecord) -> Usage:
    return Usage(prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens,
                 total_tokens=rec.prompt_tokens + rec.completion_tokens)  # fmt: skip


class Stream:
    """One streamed choice: tokens arrive from the decoding thread, text goes out as SSE chunks. Text that
    could still become a stop string is held back; with tools offered, text that could be a tool call is too,
    and the calls go out as `tool_calls` deltas once the reply is complete. The choice's logprobs ride on its
    last chunk."""

    def __init__(self, service: Service, req: Parsed, chat: bool, index: int = 0):
        self.service, self.req, self.chat, self.index = service, req, chat, index
        self.hold = max((len(s) for s in req.params.stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""
        self.created = int(time.time())

    def chunk(self, delta: dict | None = None, text: str | None = None, finish=None, usage=None, extra=None,
              ids: dict | None = None) -> str:  # fmt: skip
        i = self.index
        if self.chat:
            choice = DeltaChoice(index=i, delta=Delta(**(delta or {})), finish_reason=finish, **(ids or {}))
        else:
            choice = TextChoice(index=i, text=text or "", finish_reason=finish, **(ids or {}))
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        done = {"usage": usage} if usage is not None else {}
        doc = Completion(id=self.req.id, object=obj, created=self.created, model=self.service.cfg.model_name,
                         choices=[choice], **done, **(extra or {}))  # fmt: skip
        return "data: " + json.dumps(doc.dump()) + "\n\n"

    def content(self, text: str) -> str:
        return self.chunk({"role": "assistant", "content": text}, text)

    def progress(self) -> str | None:
        """The chunk for the text decoded so far that is safe to send, if any."""
        text = self.service.engine.target.decode(self.tokens)
        safe = text[: len(text) - self.hold] if self.hold else text
        if safe.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next token
        if self.req.tool_names is not None:
            safe = streamable_prefix(safe)
        if len(safe) <= len(self.sent):
            return None
        out, self.sent = safe[len(self.sent) :], safe
        return self.content(out)

    def finish(self, res, rec: RequestRecord | None) -> list[str]:
        """The choice's last chunks; with the request's record (the last choice), usage and extras ride along."""
        # completions never carry tools, so their text comes back whole
        content, calls, finish = self.service.reply(self.req, res.text, res.finish_reason)
        out = []
        rest = content or ""
        if len(rest) > len(self.sent) and rest.startswith(self.sent):
            out.append(self.content(rest[len(self.sent) :]))
        for i, c in enumerate(calls):
            out.append(self.chunk({"role": "assistant", "tool_calls": [{"index": i, **c}]}))
        ids = self.service.choice_extras(self.req, res, self.chat)
        if rec is None:
            out.append(self.chunk(None, None, finish, ids=ids))
        else:
            out.append(self.chunk(None, None, finish, usage(rec), self.service.extras(self.req, rec), ids))
        return out


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


def read_json(raw: bytes, content_type: str = "application/json"):
    """A request body -> its JSON value, or BadRequest naming what is wrong with it."""
    try:
        return protocol_read_json(raw, content_type)
    except RequestInvalid as e:
        raise BadRequest(str(e)) from None


def swap_request(service: Service, authorization: str | None, raw: bytes) -> dict:
    """POST /v1/dspine/drafter: the admin key checked, the body parsed, the drafter swapped -> what changed;
    BadRequest (403 disabled, 401 wrong key, 400 bad body or a refused checkpoint) before anything changes."""
    from dspine.checkpoint import CheckpointError

    if not service.cfg.admin_key:
        raise BadRequest("drafter swaps are disabled: start dspine serve with --admin-key", status=403)
    if authorization != f"Bearer {service.cfg.admin_key}":
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
        raise BadRequest("'drafter' must be a checkpoint folder or 'none'", param="drafter")
    for key in ("name", "route"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise BadRequest(f"'{key}' must be a string", param=key)
    if body.get("route") is not None and not ROUTE.fullmatch(body["route"]):
        raise BadRequest(f"route {body['route']!r}: {ROUTE_FORM}", param="route")
    try:
        return service.swap_drafter(body.get("drafter", "none"), body.get("name"), body.get("route"), remove)
    except (CheckpointError, ValueError) as e:  # refused before the swap: the current drafter keeps serving
        raise BadRequest(f"drafter refused: {e}", param="drafter") from None


def error_response(service: Service, e: BadRequest):
    """A refusal in OpenAI's error shape (Retry-After on 429 / 503), counted by status."""
    from fastapi.responses import JSONResponse

    service.metrics.errors.labels(str(e.status)).inc()
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
    return JSONResponse(error_body(str(e), e.status, e.param, e.code), status_code=e.status, headers=headers)


async def complete(request, service: Service, chat: bool):
    """One completion request: parse, admit, then stream or answer whole."""
    from fastapi.responses import JSONResponse, StreamingResponse

    try:
        req = service.parse(read_json(await request.body(), request.headers.get("content-type", "").lower()), chat)
        service.admit()
    except BadRequest as e:
        return error_response(service, e)
    if req.stream:  # the stream releases its place when it ends
        streams = [Stream(service, req, chat, i) for i in range(req.n)]
        return StreamingResponse(sse(request, service, streams), media_type="text/event-stream",
                                 headers={"x-dspine-request-id": req.id})  # fmt: skip
    try:
        rec, results = await run_watched(request, service, req)
    except BadRequest as e:
        return error_response(service, e)
    finally:
        service.release()
    return JSONResponse(service.response(req, rec, results, chat), headers={"x-dspine-request-id": rec.request_id})


def probe(h: dict, key: str):
    from fastapi.responses import JSONResponse

    return JSONResponse(h, status_code=200 if h[key] else 503)


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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, service, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, service, False)

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

    @app.get("/v1/dspine/drafter")
    async def drafter_info():
        return service.drafters()

    @app.post("/v1/dspine/drafter")
    async def drafter_swap(request: Request):  # {"drafter": FOLDER | "none", "name", "route", "remove": optional}
        from starlette.concurrency import run_in_threadpool

        try:
            return await run_in_threadpool(swap_request, service, request.headers.get("authorization"),
                                           await request.body())  # fmt: skip
        except BadRequest as e:
            return error(e)

    @app.get("/health")
    async def health():  # liveness: 503 when the decode loop died or stalled
        return probe(service.health(), "live")

    @app.get("/ready")
    async def ready():  # readiness: 503 while shutting down or with the queue full
        return probe(service.health(), "ready")

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/dspine/requests")
    async def recent(limit: int = 20):  # the latest finished requests' records, newest first
        return {"data": [r.to_json() for r in list(service.records.values())[-max(1, min(limit, 1000)) :][::-1]]}

    @app.get("/v1/dspine/requests/{rid}")
    async def record(rid: str):
        rec = service.records.get(rid)
        if rec is None:
            return error(BadRequest(f"no finished request {rid!r}", status=404))
        return rec.to_json()

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

    config = uvicorn.Config(create_app(service), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=int(grace) + 5)  # fmt: skip
    Server(config).run()


def start_server_process(
    drafter: str | None = None,
    name: str = "dspine",
    target: str | None = None,
    port: int | None = None,
    extra: list[str] | None = None,
    log=None,
):
    """`dspine serve` as a child process on 127.0.0.1 -> (process, base URL), once /health answers."""
    import subprocess
    import sys

    port = port or free_port()
    cmd = [sys.executable, "-m", "dspine.cli", "serve", "--port", str(port), "--served-model-name", name]
    cmd += ["--drafter", str(drafter) if drafter else "none"] + (["--target", target] if target else []) + (extra or [])
    proc = subprocess.Popen(cmd, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", proc, 240)
    return proc, base
