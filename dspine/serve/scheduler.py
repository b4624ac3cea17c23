"""The continuous-batching scheduler of `dspine serve`: one decoding thread that runs every batch round by round
(decode.BatchDecode) and moves requests in and out between rounds."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from dspine.engine import BatchDecode, Engine

if TYPE_CHECKING:
    from dspine.serve.drafters import Route


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

    def submit(self, rows: list[tuple], route: Route | None = None, workload: str = "default") -> list:
        """rows: [(prompt ids, SamplingParams, on_token)], decoded by `route`'s engine (None: the default engine
        when their batch starts); blocks until all are decoded -> [GenerationResult] (raises what decoding
        raised). `workload`: whose part of a suffix corpus drafts for them."""
        for ids, _, _ in rows:
            (route.engine if route else self.engine).prompt_ids(ids)  # a bad prompt fails alone, before it joins
        futs = []
        for ids, params, on_token in rows:
            futs.append(Future())
            self.jobs.put((ids, params, on_token or (lambda tok: True), futs[-1], route, workload))
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
            run = BatchDecode(
                engine,
                [j[0] for j in group],
                [j[1] for j in group],
                [j[2] for j in group],
                group,
                workloads=[j[5] for j in group],
            )
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
