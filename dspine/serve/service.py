"""A served target independent of the HTTP framework: admission (a bounded queue), liveness and readiness,
shutdown with a grace period, generation through the scheduler, the drafters (serve.drafters), request records and
Prometheus metrics."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import replace

from dspine.engine import Engine
from dspine.sampling import RequestError
from dspine.serve.config import ServeConfig
from dspine.serve.drafters import DrafterRegistry, Route
from dspine.serve.metrics import AcceptanceMetrics
from dspine.serve.openai import BadRequest, OpenAIShaping, Parsed
from dspine.serve.records import RequestRecord
from dspine.serve.scheduler import Batcher


class ServerMetrics:
    """The acceptance families (serve.metrics) by workload × thinking × method, plus refusals and in-flight."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.acceptance = AcceptanceMetrics("dspine", ("workload", "thinking", "method"), self.registry)
        self.errors = Counter("dspine_request_errors", "refused requests", ("code",), registry=self.registry)
        self.inflight = Gauge("dspine_inflight_requests", "requests being served", registry=self.registry)


class Service(OpenAIShaping):
    """One served target: admission, health and shutdown, generation through the scheduler, records; the drafters
    in `registry`, parsing and reply shaping from OpenAIShaping. Independent of the HTTP framework."""

    def __init__(self, engine: Engine, cfg: ServeConfig | None = None, drafter_name: str | None = None):
        self.cfg = cfg or ServeConfig()
        name = drafter_name or (engine.method if engine.drafter is not None else None)
        self.batcher = Batcher(engine, self.cfg.max_batch, name)
        self.records: OrderedDict[str, RequestRecord] = OrderedDict()
        self.metrics = ServerMetrics()
        self.admitted = 0
        self.lock = threading.Lock()
        self.registry = DrafterRegistry(engine, name, self.batcher, self.cfg.draft_dtype, self.lock)
        self.stopping = False
        self.abort_all = threading.Event()  # set when the shutdown grace period is over
        tgt = engine.target
        self.max_prompt = self.cfg.max_prompt_tokens or tgt.info.max_position_embeddings - 1
        self.template_sha256 = self.template_hash(tgt.tokenizer)

    # ---- the drafters (DrafterRegistry) ------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        return self.registry.engine

    @property
    def drafter_name(self) -> str | None:
        return self.registry.name

    @property
    def drafter_path(self) -> str | None:
        return self.registry.path

    @drafter_path.setter
    def drafter_path(self, path: str | None) -> None:
        self.registry.serve_from(path)

    def swap_drafter(self, path: str, name: str | None = None, route: str | None = None, remove: bool = False) -> dict:
        """Serve another drafter ("none": AR; "builtin": the one shipped for the target), by default or for one
        route (DrafterRegistry.swap)."""
        if path == "builtin":
            from dspine.checkpoint import resolve_drafter

            path = resolve_drafter(path, self.engine.target.name)
        return self.registry.swap(path, name, route, remove)

    def route_for(self, req: Parsed) -> Route | None:
        return self.registry.route_for(req.workload, req.effort)

    def drafters(self) -> dict:
        """GET /v1/dspine/drafter: the default drafter, the routes, the latest swaps."""
        return self.registry.info()

    # ---- admission, health, shutdown --------------------------------------------------------------------
    def admit(self) -> None:
        """Take a place for one request, or refuse it: 503 while shutting down, 429 when the queue is full."""
        with self.lock:
            if self.stopping:
                raise BadRequest("the server is shutting down", status=503, code="shutting_down", retry_after=5)
            if self.admitted >= self.cfg.max_queue:
                raise BadRequest(
                    f"the server is busy ({self.admitted} requests admitted, at most "
                    f"{self.cfg.max_queue}); retry later",
                    status=429,
                    code="queue_full",
                    retry_after=1,
                )
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
        return {
            "status": "stopping" if self.stopping else ("ok" if live else "stalled"),
            "live": live,
            "ready": ready,
            "admitted": self.admitted,
            "max_queue": self.cfg.max_queue,
            "decoding": b.decoding,
            "last_progress_age_s": round(age, 3),
        }

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop admitting; in-flight requests may finish for grace_s, then every row aborts at its next token."""
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
        timer = threading.Timer(grace_s, self.abort_all.set)
        timer.daemon = True
        timer.start()

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
        route = self.route_for(req)
        try:
            results = self.batcher.submit(rows, route, req.workload)
        except RequestError as e:
            raise BadRequest(str(e)) from None
        finally:
            self.metrics.inflight.dec()
        corpus = (route.engine if route is not None else self.engine).corpus
        if corpus is not None:  # suffix drafting: the served traffic, per workload, drafts for what follows
            for r in results:
                if r.finish_reason != "abort":
                    corpus.add(r.token_ids, req.workload)
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
            cached_tokens=res.cached_tokens,
            completion_tokens=sum(r.completion_tokens for r in results),
            finish_reason=res.finish_reason,
            latency_s=time.time() - t0,
            ts=t0,
            accept_hist=hist,
            source="engine" if hist is not None else None,
            batch_size=max(r.batch_size for r in results),
            text=res.text,
            prompt_token_ids=list(req.ids) if req.record_ids else None,
            completion_token_ids=list(res.token_ids) if req.record_ids else None,
        )
        self.records[rec.request_id] = rec
        while len(self.records) > self.cfg.max_records:
            self.records.popitem(last=False)
        self.metrics.acceptance.observe(rec)
        return rec, results
