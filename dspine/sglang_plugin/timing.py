"""Where a speculative round's time goes inside SGLang (on when DSPINE_SGLANG_TIMING names a JSON file).

CUDA events around each decode round of the DFlash worker (DSpine and DFlash drafters alike), around the
draft model runner's forward inside it (the draft graph: drafter layers, injection, proposal) and around the
target's verify forward; glue = round − draft − verify (block preparation, acceptance, KV materialisation).
Events are read back every `every` rounds, after one synchronisation, and the running means are written to
the file atomically — serving is not slowed by per-round syncs.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

_ACTIVE: dict | None = None  # the round being timed: {"worker", "events"}


class RoundTimer:
    def __init__(self, path: str, every: int = 20):
        self.path, self.every = Path(path), every
        self.pending: list[dict] = []
        self.totals = {"rounds": 0, "round": 0.0, "draft": 0.0, "verify": 0.0}

    @staticmethod
    def _event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def round(self, original, worker, *args, **kwargs):
        global _ACTIVE
        batch = args[0] if args else kwargs.get("batch")
        mode = getattr(batch, "forward_mode", None)
        if mode is None or mode.is_extend() or getattr(batch, "is_extend_in_batch", False) or mode.is_idle():
            return original(worker, *args, **kwargs)
        ev = {"start": self._event()}
        _ACTIVE = {"worker": worker, "events": ev}
        try:
            out = original(worker, *args, **kwargs)
        finally:
            _ACTIVE = None
        ev["end"] = self._event()
        self.pending.append(ev)
        if len(self.pending) >= self.every:
            self.flush()
        return out

    @staticmethod
    def _span(name: str, original, *args, **kwargs):
        ev = _ACTIVE["events"]
        ev[name + "_start"] = RoundTimer._event()
        out = original(*args, **kwargs)
        ev[name + "_end"] = RoundTimer._event()
        return out

    def draft(self, original, runner, *args, **kwargs):
        if _ACTIVE is None or runner is not getattr(_ACTIVE["worker"], "draft_model_runner", None):
            return original(runner, *args, **kwargs)
        return self._span("draft", original, runner, *args, **kwargs)

    def verify(self, original, tp_worker, *args, **kwargs):
        if _ACTIVE is None or not kwargs.get("is_verify", False):
            return original(tp_worker, *args, **kwargs)
        return self._span("verify", original, tp_worker, *args, **kwargs)

    def flush(self) -> None:
        self.pending[-1]["end"].synchronize()
        for ev in self.pending:
            self.totals["rounds"] += 1
            self.totals["round"] += ev["start"].elapsed_time(ev["end"])
            for k in ("draft", "verify"):
                if k + "_start" in ev:
                    self.totals[k] += ev[k + "_start"].elapsed_time(ev[k + "_end"])
        self.pending.clear()
        write_means(self.path, self.totals)


def write_means(path: Path, totals: dict) -> dict:
    """Per-round means in ms (glue = round − draft − verify), written atomically; returns them."""
    n = max(1, totals["rounds"])
    doc = {"rounds": totals["rounds"], **{f"{k}_ms": totals[k] / n for k in ("round", "draft", "verify")}}
    doc["glue_ms"] = doc["round_ms"] - doc["draft_ms"] - doc["verify_ms"]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".timing-")
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
    return doc
