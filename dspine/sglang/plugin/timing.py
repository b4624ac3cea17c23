"""Where a speculative round's time goes inside SGLang (on when DSPINE_SGLANG_TIMING names a JSON file).

CUDA events around each decode round of the DFlash worker (DSpine and DFlash drafters alike), around the
draft model runner's forward inside it (the draft graph: drafter layers, injection, proposal) and around the
target's verify forward; glue = round − draft − verify (block preparation, acceptance, KV materialisation).
Prefill (extend) calls of the worker are timed too. Events are read back without blocking (only those the
GPU has passed) every `every` rounds and at every prefill, and the running totals are written to the file
atomically — serving is never stalled by a synchronisation. A reader that diffs two snapshots of the totals
gets the split of the rounds between them (`dspine bench --backend sglang` does, per concurrency).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspine.io import atomic_write_text

_ACTIVE: dict | None = None  # the round being timed: {"worker", "events"}
PHASES = ("round", "draft", "verify", "extend")


def cuda_event():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


class RoundTimer:
    """`event()` returns a recorded event with query() and elapsed_time(other) (CUDA's, in SGLang)."""

    def __init__(self, path: str, every: int = 20, event=cuda_event):
        self.path, self.every, self._event = Path(path), every, event
        self.pending: list[dict] = []
        self.totals = {"rounds": 0, "extends": 0, **{k: 0.0 for k in PHASES}}

    def round(self, original, worker, *args, **kwargs):
        global _ACTIVE
        batch = args[0] if args else kwargs.get("batch")
        mode = getattr(batch, "forward_mode", None)
        if mode is None or mode.is_idle():
            return original(worker, *args, **kwargs)
        extend = mode.is_extend() or getattr(batch, "is_extend_in_batch", False)
        if extend and self.pending:
            self.flush()  # a new request: whatever ran before it is done or nearly so
        ev = {"kind": "extend" if extend else "round", "start": self._event()}
        _ACTIVE = None if extend else {"worker": worker, "events": ev}
        try:
            out = original(worker, *args, **kwargs)
        finally:
            _ACTIVE = None
        ev["end"] = self._event()
        self.pending.append(ev)
        if len(self.pending) >= self.every:
            self.flush()
        return out

    def _span(self, name: str, original, *args, **kwargs):
        ev = _ACTIVE["events"]
        ev[name + "_start"] = self._event()
        out = original(*args, **kwargs)
        ev[name + "_end"] = self._event()
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
        """Fold in the events the GPU has passed (in order; stops at the first one still ahead), write."""
        done = 0
        for ev in self.pending:
            if not ev["end"].query():
                break
            done += 1
            span = ev["start"].elapsed_time(ev["end"])
            if ev["kind"] == "extend":
                self.totals["extends"] += 1
                self.totals["extend"] += span
                continue
            self.totals["rounds"] += 1
            self.totals["round"] += span
            for k in ("draft", "verify"):
                if k + "_start" in ev:
                    self.totals[k] += ev[k + "_start"].elapsed_time(ev[k + "_end"])
        if done:
            del self.pending[:done]
            write_totals(self.path, self.totals)


def split(totals: dict, before: dict | None = None) -> dict:
    """Totals (or the difference of two snapshots) -> per-round means in ms (glue = round − draft − verify),
    the rounds and prefills counted, and their summed GPU time in ms."""
    d = {k: totals[k] - (before or {}).get(k, 0) for k in ("rounds", "extends", *PHASES)}
    n = max(1, d["rounds"])
    out = {
        "rounds": d["rounds"],
        "extends": d["extends"],
        "round_ms": d["round"] / n,
        "draft_ms": d["draft"] / n,
        "verify_ms": d["verify"] / n,
        "rounds_total_ms": d["round"],
        "extend_total_ms": d["extend"],
    }
    out["glue_ms"] = out["round_ms"] - out["draft_ms"] - out["verify_ms"]
    return out


def write_totals(path: Path, totals: dict) -> None:
    """The running totals, written atomically (a reader never sees half a file)."""
    atomic_write_text(path, json.dumps({"totals": totals, **split(totals)}))
