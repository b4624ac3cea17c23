"""The drafters one `dspine serve` holds beside its target: the default one and one per route (a workload, or a
workload and thinking level), swapped while serving — each checked against the target before it replaces anything;
batches already decoding finish on the drafter they began with."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from dspine.engine import Engine
from dspine.serve.protocol import ROUTE, ROUTE_FORM, route_of_request


@dataclass
class Route:
    """A drafter serving the requests of one workload (and thinking level) beside the default one."""

    engine: Engine
    label: str | None
    path: str | None

    def info(self) -> dict:
        return {"drafter": self.label, "path": shown_path(self.path), "method": self.engine.method}


def drafter_label(path: str) -> str:
    """How records, /v1/models and swaps name a drafter folder: its last two path parts (never an absolute path)."""
    from pathlib import Path

    return "/".join(Path(path).resolve().parts[-2:])


def shown_path(path: str | None) -> str | None:
    """A drafter folder as the drafter reads show it: relative to the server's working directory when inside it
    (where a swap back resolves it again), else as given."""
    if path is None or not os.path.isabs(path):
        return path
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


class DrafterRegistry:
    """The default engine (`engine`, `name`, `path`), the routes, the swap history; `batcher` decodes new batches
    with the default engine after a swap. `draft_dtype`: what swapped-in drafters decode in (None: the target's)."""

    def __init__(self, engine: Engine, name: str | None, batcher, draft_dtype: str | None, lock: threading.Lock):
        self.engine, self.name, self.path = engine, name, None  # path: the folder served (what a rollback swaps to)
        self.batcher, self.draft_dtype, self.lock = batcher, draft_dtype, lock
        self.swaps: list[dict] = []
        self.routes: dict[str, Route] = {}  # "tool" / "tool/high" -> a drafter beside the default one
        self.labels: dict[str, str] = {}  # label -> the folder it names (resolved): two folders never share one

    def serve_from(self, path: str | None) -> None:
        """The folder the start's drafter came from (what a rollback swaps to); its label now names that folder."""
        self.path = path
        if path and self.name:
            self.labels[self.name] = os.path.realpath(path)

    def unique_label(self, label: str, path: str) -> str:
        """`label` for the folder `path`, unless it already names another folder: then `label@` and a short hash
        of the folder, so records tell the two apart."""
        import hashlib

        where = os.path.realpath(path)
        if self.labels.get(label, where) != where:
            label = f"{label}@{hashlib.sha1(where.encode()).hexdigest()[:6]}"
        self.labels[label] = where
        return label

    def swap(self, path: str, name: str | None = None, route: str | None = None, remove: bool = False) -> dict:
        """Serve another drafter ("none": AR): loaded and checked against the target first (a wrong or broken
        checkpoint raises CheckpointError and the current one keeps serving); batches already decoding
        finish on the old drafter, new ones start on the new -> {"previous", "current"} (and "route"). With a
        `route` (WORKLOAD or WORKLOAD/LEVEL) only that workload's requests change drafter; `remove` sends them
        back to the default one."""
        if route is not None:
            return self._swap_route(route, path, name, remove)
        engine, label = self._engine_for(path, name)
        with self.lock:
            previous = {"drafter": self.name, "path": shown_path(self.path), "method": self.engine.method}
            self.engine, self.name, self.path = engine, label, None if engine.drafter is None else path
            self.batcher.use(engine, label)
            current = {"drafter": label, "path": shown_path(self.path), "method": engine.method}
            self.swaps.append({"ts": time.time(), "previous": previous, "current": current})
        return {"previous": previous, "current": current}

    def _engine_for(self, path: str, name: str | None) -> tuple[Engine, str | None]:
        from dspine.checkpoint import draft_dtype, load_drafter

        tgt = self.engine.target
        dtype = draft_dtype(self.draft_dtype, tgt.dtype, tgt.device)
        drafter = None if path == "none" else load_drafter(path, tgt, dtype=dtype, device=tgt.device)
        cur = self.engine  # its decode-time choices carry over where the new drafter's block allows them
        B = drafter.config.block_size if drafter is not None else 1
        keep = cur.draft_len if drafter is not None and cur.drafter is not None and cur.draft_len <= B - 1 else None
        chosen = cur.drafter is not None and cur.draft_block < cur.drafter.config.block_size  # not the whole block
        block = cur.draft_block if keep is not None and chosen and cur.draft_block <= B else None
        tree = cur.tree if keep is not None and cur.tree is not None and cur.tree.fits(drafter.config) else None
        engine = Engine(
            tgt,
            drafter,
            keep,
            block,
            cur.spec_max_batch,
            tree,
            cur.policy is not None,
            cur.suffix,
            cur.corpus,
            cur.prefix_cache,  # its entries are the target's, shared (the features are kept per target layers)
        )
        return engine, None if drafter is None else (name or self.unique_label(drafter_label(path), path))

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

    def route_for(self, workload: str, effort: str) -> Route | None:
        """The most specific route of a request's workload and thinking level; None: the default drafter."""
        with self.lock:
            return route_of_request(self.routes, workload, effort)

    def info(self) -> dict:
        """GET /v1/dspine/drafter: the default drafter, the routes, the latest swaps."""
        with self.lock:
            routes = {k: r.info() for k, r in sorted(self.routes.items())}
            return {
                "drafter": self.name,
                "path": shown_path(self.path),
                "method": self.engine.method,
                "routes": routes,
                "swaps": self.swaps[-20:],
            }
