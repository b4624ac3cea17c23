"""The one training entry: `dspine train` and the acceptance recipe both call `run`.

`run` builds each named drafter for the target (method + config overrides, seeded), optionally copies weights
from another checkpoint (`warm_start`: weights only, a new run), measures held-out simulated τ before training,
trains all drafters in lockstep (train.loop) and returns a report of what happened. The held-out split has one
rule (`split_heldout`): a seeded shuffle of the samples whose prompt leaves room for a response, so the held-out
set spans every prompt pool and length.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspine.checkpoint import CheckpointError, load_drafter
from dspine.config import ConfigError
from dspine.drafter import DSpineDraftModel
from dspine.train.loop import TrainConfig, train_drafters
from dspine.train.losses import evaluate_tau_sims

Sample = tuple[list[int], int]  # (token ids, index of the first response token)


@dataclass
class DrafterSpec:
    """One drafter of a run: its method, DSpineConfig overrides and loss overrides (an ablation), and its own
    initialisation seed (None: the run's `train.seed`) — a second seed of a pair trained in the same lockstep,
    on the same batches and anchors, so two seeds cost one run's data and evaluation."""

    method: str = "dspine"
    drafter: dict[str, Any] = field(default_factory=dict)  # e.g. transfer_rank, message_size
    loss: dict[str, float] = field(default_factory=dict)  # gamma / cos_weight / redo_weight / redo_split
    seed: int | None = None


def split_heldout(
    samples: list[Sample], heldout: int, seed: int, max_len: int, train_only: list[Sample] = ()
) -> tuple[list, list]:
    """(train, held-out): samples whose prompt leaves room for a response, seeded-shuffled, the first
    `heldout` kept out; then `train_only` (such samples too) joins training, leaving the held-out set as it
    was drawn from `samples` alone."""
    pairs = [p for p in samples if p[1] < max_len - 16]
    random.Random(seed).shuffle(pairs)
    return pairs[heldout:] + [p for p in train_only if p[1] < max_len - 16], pairs[:heldout]


def warm_start(drafters: list[DSpineDraftModel], checkpoint: str | Path, target) -> list[int]:
    """Copy the weights of `checkpoint` (read once) whose names and shapes fit each drafter (weights only:
    optimizer, step and schedule start afresh) -> the number of tensors copied into each; none fitting is an
    error."""
    src = load_drafter(checkpoint, target).state_dict()
    copied = []
    for drafter in drafters:
        mine = drafter.state_dict()
        shared = {k: v for k, v in src.items() if k in mine and v.shape == mine[k].shape}
        if not shared:
            raise CheckpointError(f"warm start from {checkpoint}: no weights fit this drafter")
        drafter.load_state_dict(shared, strict=False)
        copied.append(len(shared))
    return copied


def build_drafters(
    target, specs: dict[str, DrafterSpec], layers: int, block_size: int, seed: int, dtype: torch.dtype, device: str
) -> dict[str, DSpineDraftModel]:
    return {
        n: DSpineDraftModel.for_target(
            target,
            method=s.method,
            seed=seed if s.seed is None else s.seed,
            **{"num_hidden_layers": layers, "block_size": block_size, **s.drafter},
        ).to(device=device, dtype=dtype)
        for n, s in specs.items()
    }


def run(
    target,
    samples: list[Sample],
    specs: dict[str, DrafterSpec],
    outs: dict[str, str | Path],
    cfg: TrainConfig,
    *,
    layers: int = 5,
    block_size: int = 16,
    heldout: int = 64,
    train_only: list[Sample] = (),
    resume: bool = False,
    warm_from: str | Path | dict[str, str | Path] | None = None,
    before: dict[str, float] | None = None,
    rank: int = 0,
    progress: bool = True,
    log_path: str | Path | None = None,
    extra: dict | None = None,
) -> dict:
    """Train the drafters of `specs` in lockstep on `samples` -> a report (rank 0; {} on other ranks).

    outs[name] receives best/ and last/. `train_only`: samples added to training after the held-out split of
    `samples` is drawn (that split stays the same whatever is added). `resume` continues every drafter from
    outs[name]/last; `warm_from` initialises every drafter from a checkpoint's weights instead (not both).
    `before`: held-out τ_sim before training when known (a resumed recipe); else it is measured.
    `log_path`: one JSON line per step."""
    if resume and warm_from:
        raise ConfigError("resume continues a run; a warm start begins a new one: pick one")
    dtype, device = target.dtype, str(target.device)
    train_pairs, eval_pairs = split_heldout(samples, heldout, cfg.seed, cfg.max_len, train_only)
    if not train_pairs or not eval_pairs:
        raise ConfigError(f"{len(samples)} samples are too few for a held-out set of {heldout} and a training set")
    drafters = build_drafters(target, specs, layers, block_size, cfg.seed, dtype, device)
    if isinstance(warm_from, dict):
        for n, d in drafters.items():
            warm_start([d], warm_from[n], target)
    elif warm_from:
        warm_start(list(drafters.values()), warm_from, target)
    for d in drafters.values():
        d.bind(target)
    losses = {n: s.loss for n, s in specs.items()}
    if before is None:
        before = evaluate_tau_sims(drafters, target, eval_pairs, cfg, losses=losses) if rank == 0 else {}
    t0 = time.time()
    with open(log_path, "a") if log_path and rank == 0 else contextlib.nullcontext() as logf:
        hist = train_drafters(
            drafters,
            target,
            train_pairs,
            cfg,
            eval_samples=eval_pairs,
            progress=progress,
            log=(lambda row: logf.write(json.dumps(row) + "\n")) if logf is not None else None,
            outs={n: Path(o) for n, o in outs.items()},
            resume=resume,
            extra={**(extra or {}), "warm_start": _jsonable_path(warm_from)},
            losses=losses,
        )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    secs = time.time() - t0
    if rank > 0:
        return {}
    methods = {}
    for n, h in hist.items():
        evals = [(r["step"], r["eval_tau_sim"]) for r in h if "eval_tau_sim" in r]
        methods[n] = {
            **asdict(specs[n]),
            "tau_sim_before": before[n],
            "tau_sim_after": evals[-1][1] if evals else before[n],
            "best_tau_sim": max((t for _, t in evals), default=before[n]),
            "eval_curve": evals,
            "loss_first": h[0]["loss"] if h else None,
            "loss_last": h[-1]["loss"] if h else None,
        }
    steps = len(next(iter(hist.values())))
    return {
        "samples": len(train_pairs),
        "heldout": len(eval_pairs),
        "methods": methods,
        "steps": steps,
        "seconds": secs,
        "elapsed_total_s": next(iter(hist.values()))[-1]["elapsed_s"] if steps else 0.0,
    }


def _jsonable_path(p):
    return {n: str(v) for n, v in p.items()} if isinstance(p, dict) else (str(p) if p else None)
