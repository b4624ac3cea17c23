"""Replaying held-out agent traces through the engine: base vs adapted drafter per workload × thinking level
(`adapt/evaluate.py`), plus the seven general benchmarks, and the gate that decides whether an adapted
drafter may be deployed.

Design choices:
- **Exact token prefixes**: every held-out trace row (one model call) is decoded again from its recorded
  prompt ids with its recorded completion forced (`Engine.generate(forced=...)`), so base and adapted face the
  very same text and their acceptance differs only by the drafter; τ pools the rounds of a cell
  (AcceptanceStats.merge), the per-slot acceptance beside it; held-out rows are replayed `batch_size` at a time
  (BatchDecode with forced rows: the same rounds as one at a time). Held-out means the episodes finetune.json
  names (split by episode, never by turn; or by task); how many held-out tasks the fine-tune also saw (the same
  task at another level or in another episode) is reported beside the table.
- **General skills**: `eval.acceptance.evaluate` on the seven benchmarks at T = 0 for base and every adapted
  drafter; regression = 1 − τ(adapted) / τ(base) on the benchmark mean.
- **The gate** refuses an adapted drafter whose τ on any of its cells is below the base's (`min_ratio`,
  default 1.0) or whose general regression exceeds `max_general_regression` (default 2%); the decision and
  its figures are written with the evaluation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dspine.stats import AcceptanceStats

BENCHMARKS = ["gsm8k", "math500", "humaneval", "mbpp", "livecodebench", "mt_bench", "arena_hard"]


@dataclass
class EvalConfig:
    finetune: str = ""  # a fine-tune's output folder (finetune.json)
    out: str = ""  # adapt.json (adapt.md beside it)
    benchmarks: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    limit: int = 2  # items per benchmark; 0: no general benchmarks
    max_new_tokens: int = 64
    max_rows: int = 0  # held-out rows replayed per group, taken in turn from each of its cells; 0: all
    min_ratio: float = 1.0  # gate: τ(adapted) / τ(base) on each of its cells at least this
    max_general_regression: float = 0.02  # gate: 1 − τ(adapted) / τ(base) on the benchmark mean at most this
    batch_size: int = 8  # held-out rows replayed together (one drafter, by prompt length)
    general_workers: int = 1  # processes for the general benchmarks (a GPU is shared well by several)
    summary: str = ""  # summary.json whose `adaptation` section is rewritten


def cell_of(row: dict) -> str:
    return f"{row['workload']}/{row['thinking']}"


def _spread(rows: list[dict], n: int) -> list[dict]:
    """The first n rows taken in turn from each cell (each cell's rows in their order)."""
    by_cell: dict = {}
    for r in rows:
        by_cell.setdefault(cell_of(r), []).append(r)
    cells, out = list(by_cell.values()), []
    for k in range(max(map(len, cells), default=0)):
        out += [c[k] for c in cells if k < len(c)]
    return out[:n]


def gate(doc: dict, min_ratio: float = 1.0, max_general_regression: float = 0.02) -> dict:
    """{group: {"accept": bool, "reasons": [...]}} from an evaluation document."""
    out = {}
    for g, info in doc["drafters"].items():
        reasons = []
        for c in info["cells"]:
            r = doc["per_cell"][c]["ratio"]
            if r < min_ratio:
                reasons.append(f"{c}: τ ratio {r:.3f} < {min_ratio}")
        reg = (doc.get("general") or {}).get("regression", {}).get(g)
        if reg is not None and reg > max_general_regression:
            reasons.append(f"general benchmarks regress {reg:.1%} > {max_general_regression:.0%}")
        out[g] = {"accept": not reasons, "reasons": reasons}
    return out


def evaluate_adaptation(cfg: EvalConfig, progress: bool = True) -> dict:
    """Replay every group's held-out rows with the base and its adapted drafter, run the general benchmarks,
    gate -> the document (written to cfg.out, with a Markdown table beside it)."""
    import torch

    from dspine.adapt.finetuning import group_of
    from dspine.agents.traces import load_traces
    from dspine.checkpoint import load_drafter, resolve_drafter
    from dspine.eval.acceptance import benchmark_means, evaluate, replay
    from dspine.io import update_summary
    from dspine.target import load_target

    ft = json.loads((Path(cfg.finetune) / "finetune.json").read_text())
    fc = ft["config"]
    target = load_target(fc["target"], dtype=getattr(torch, fc["dtype"]), device=fc["device"])
    base_path = str(resolve_drafter(fc["base"], fc["target"]))
    base = load_drafter(base_path, target, device=fc["device"])
    rows = load_traces(fc["traces"]).to_pylist()
    per_cell: dict = {}
    drafters: dict = {}
    for g, info in ft["groups"].items():
        held = set(info["heldout_episodes"])
        grows = [r for r in rows if r["episode_id"] in held and r["has_token_ids"] and r["completion_token_ids"]]
        if cfg.max_rows:
            grows = _spread(grows, cfg.max_rows)
        adapted = load_drafter(info["drafter"], target, device=fc["device"])
        jobs = [(n, list(r["prompt_token_ids"]), list(r["completion_token_ids"])) for r in grows for n in ("base", g)]
        res = replay(target, {"base": base, g: adapted}, jobs, progress=progress, batch_size=cfg.batch_size)
        cells = {}
        for (name, _, _), r, row in zip(jobs, res, [r for r in grows for _ in (0, 1)]):
            st = AcceptanceStats(r["block_size"], r["accept_hist"])
            key = cell_of(row)
            side = "base" if name == "base" else "adapted"
            cell = cells.setdefault(key, {"rows": 0})
            cell[side] = cell[side].merge(st) if side in cell else st
            cell["rows"] += side == "base"
        for key, cell in cells.items():
            b, a = cell["base"], cell["adapted"]
            per_cell[key] = {
                "base": b.tau,
                "adapted": a.tau,
                "ratio": a.tau / b.tau,
                "rows": cell["rows"],
                "rounds": {"base": b.rounds, "adapted": a.rounds},
                "per_slot": {"base": b.per_slot, "adapted": a.per_slot},
                "drafter": g,
            }
        mine = [r for r in rows if group_of(r, fc.get("per", "all")) == g]
        tasks = {(r["workload"], r["task_id"]) for r in mine if r["episode_id"] in held}
        trained = {(r["workload"], r["task_id"]) for r in mine if r["episode_id"] not in held}
        drafters[g] = {
            "path": info["drafter"],
            "cells": sorted(cells),
            "adapted": adapted,
            "split": fc.get("split", "episode"),
            "heldout_tasks": len(tasks),
            "heldout_tasks_seen": len(tasks & trained),
        }
    models = {"base": base, **{g: d.pop("adapted") for g, d in drafters.items()}}
    general = None
    if cfg.limit:
        _finish(cfg, per_cell, drafters, None, pending=True)  # the replay kept should the benchmarks be cut short
        paths = {"base": base_path, **{g: d["path"] for g, d in drafters.items()}}
        ev = evaluate(
            target,
            models,
            cfg.benchmarks,
            cfg.limit,
            [0.0],
            cfg.max_new_tokens,
            progress=progress,
            workers=cfg.general_workers,
            target_spec=(fc["target"], fc["dtype"], fc["device"]),
            drafter_paths=paths,
        )
        means = benchmark_means(ev["results"])["T0"]
        general = {
            "tau_mean": {n: means[n] for n in models},
            "regression": {g: 1 - means[g] / means["base"] for g in drafters},
            "benchmarks": cfg.benchmarks,
            "limit": cfg.limit,
            "max_new_tokens": cfg.max_new_tokens,
        }
    doc = _finish(cfg, per_cell, drafters, general)
    if cfg.summary:
        update_summary(cfg.summary, "adaptation", summary_section(doc))
    return doc


def _finish(cfg: EvalConfig, per_cell: dict, drafters: dict, general: dict | None, pending: bool = False) -> dict:
    """The evaluation document, gated and written (cfg.out and its .md). `pending`: the general benchmarks are
    still to run — every drafter refused until they have."""
    from dspine.io import atomic_write_text, provenance

    doc = {"per_cell": per_cell, "drafters": drafters, "general": general, "finetune": str(cfg.finetune)}
    doc["min_ratio"] = min((c["ratio"] for c in per_cell.values()), default=None)
    doc["general_regression"] = max(general["regression"].values()) if general else None
    doc["gate"] = gate(doc, cfg.min_ratio, cfg.max_general_regression)
    if pending:
        doc["gate"] = {g: {"accept": False, "reasons": ["general benchmarks pending"]} for g in drafters}
    doc["thresholds"] = {"min_ratio": cfg.min_ratio, "max_general_regression": cfg.max_general_regression}
    doc.update(provenance())
    if cfg.out:
        atomic_write_text(cfg.out, json.dumps(doc, indent=1))
        atomic_write_text(Path(cfg.out).with_suffix(".md"), markdown(doc))
    return doc


def summary_section(doc: dict) -> dict:
    keep = ("general_regression", "min_ratio", "git_sha", "command", "hardware")
    cells = {c: {k: v[k] for k in ("base", "adapted", "ratio")} for c, v in doc["per_cell"].items()}
    return {"per_cell": cells, **{k: doc.get(k) for k in keep}}


def markdown(doc: dict) -> str:
    from dspine.io import md_table

    rows = [
        [c, v["drafter"], v["rows"], f"{v['base']:.3f}", f"{v['adapted']:.3f}", f"{v['ratio']:.3f}"]
        for c, v in sorted(doc["per_cell"].items())
    ]
    text = "# Adaptation: held-out agent traces replayed (exact token prefixes)\n\n"
    text += md_table(["workload/level", "drafter", "rows", "τ base", "τ adapted", "ratio"], rows)
    if doc.get("general"):
        g = doc["general"]
        text += f"\n\nGeneral benchmarks (T = 0, {g['limit']} items each): τ " + ", ".join(
            f"{n} {t:.3f}" for n, t in g["tau_mean"].items()
        )
        text += "; regression " + ", ".join(f"{n} {r:+.1%}" for n, r in g["regression"].items())
    seen = [
        f"{g} {d['heldout_tasks_seen']}/{d['heldout_tasks']} (split by {d['split']})"
        for g, d in doc["drafters"].items()
        if "heldout_tasks" in d
    ]
    text += "\n\nHeld-out tasks also in training: " + ", ".join(seen)
    text += "\n\nGate: " + "; ".join(
        f"{g}: {'accept' if d['accept'] else 'refuse — ' + ', '.join(d['reasons'])}" for g, d in doc["gate"].items()
    )
    return text + f"\n\n{doc.get('git_sha', '')} · {doc.get('hardware', '')} · `{doc.get('command', '')}`\n"
