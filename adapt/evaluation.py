"""Replaying held-out agent traces through the engine: base vs adapted drafter per workload × thinking level
(`adapt/evaluate.py`), plus the seven general benchmarks, and the gate that decides whether an adapted
drafter may be deployed.

Design choices:
- **Exact token prefixes**: every held-out trace row (one model call) is decoded again from its recorded
  prompt ids with its recorded completion forced (`Engine.generate(forced=...)`), so base and adapted face the
  very same text and their acceptance differs only by the drafter; τ pools the rounds of a cell
  (AcceptanceStats.merge), the per-slot acceptance beside it; held-out rows are replayed `batch_size` at a time
  (BatchDecode with forced rows: the same rounds as one at a time). Held-out means the test episodes finetune.json
  names (by task by default, or by episode; never by turn); how many held-out tasks the fine-tune also saw (the
  same task at another level or in another episode, when split by episode) is reported beside the table.
- **General skills**: `eval.acceptance.evaluate` on the seven benchmarks at T = 0 for base and every adapted
  drafter; regression = 1 − τ(adapted) / τ(base) on the benchmark mean.
- **Honest cells**: the rows replayed are the fine-tune's test part (held out by task by default, apart from the
  validation part that picked the checkpoint and the blend). Each cell reports rows, tasks and generated tokens
  beside its pooled τ, and 95% bootstrap intervals over tasks (a task's rows resampled together) for τ base, τ
  adapted and their ratio; a cell with fewer than `min_rows` rows or `min_tasks` tasks is "too few". The general
  regression has its interval too (benchmark items resampled, base and adapted paired).
- **Thinking levels as labels**: on a target without a thinking mode a level is a system note; the document says
  so (`levels`), and cells of one workload whose rows are the same conversations at another level are marked as
  such, not as separate measurements.
- **The gate** refuses an adapted drafter when any of its cells is too few, when its τ ratio on any cell is below
  `min_ratio` (default 1.0), or when the general regression exceeds `max_general_regression` (default 2%) or its
  interval's upper end exceeds `max_general_regression_upper` (default 3%); the decision and its figures are
  written with the evaluation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dspine.options import REPLAY_PREFIX_TOKENS
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
    max_general_regression_upper: float = 0.03  # gate: the upper end of that regression's 95% interval at most this
    min_rows: int = 30  # a cell with fewer test rows is "too few": reported, and the gate refuses on it
    min_tasks: int = 3  # ... or with fewer test tasks
    draws: int = 2000  # bootstrap draws for the intervals
    batch_size: int = 8  # held-out rows replayed together (one drafter, by prompt length)
    # the base and adapted drafters' replays share one prefix cache of this many tokens (the target's K/V and
    # features of each batch's prompts, prefilled once for both; a turn extending an earlier one reuses it too);
    # memory: per token the target's K/V of every layer plus its features; 0: every replay prefills its prompt
    prefix_cache_tokens: int = REPLAY_PREFIX_TOKENS
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


def gate(
    doc: dict, min_ratio: float = 1.0, max_general_regression: float = 0.02, max_general_regression_upper: float = 1.0
) -> dict:
    """{group: {"accept": bool, "reasons": [...]}} from an evaluation document."""
    out = {}
    for g, info in doc["drafters"].items():
        reasons = [] if info["cells"] else ["no test rows: the split left none to judge on"]
        for c in info["cells"]:
            cell = doc["per_cell"][c]
            if cell.get("too_few"):
                reasons.append(f"{c}: too few ({cell['rows']} rows, {cell['tasks']} tasks)")
            r = cell["ratio"]
            if r < min_ratio:
                reasons.append(f"{c}: τ ratio {r:.3f} < {min_ratio}")
        gen = doc.get("general") or {}
        reg = gen.get("regression", {}).get(g)
        if reg is not None and reg > max_general_regression:
            reasons.append(f"general benchmarks regress {reg:.1%} > {max_general_regression:.0%}")
        ci = (gen.get("regression_ci") or {}).get(g)
        if ci is not None and ci[1] > max_general_regression_upper:
            reasons.append(f"general regression's interval reaches {ci[1]:.1%} > {max_general_regression_upper:.0%}")
        out[g] = {"accept": not reasons, "reasons": reasons}
    return out


def cell_figures(rows: list[tuple[str, AcceptanceStats, AcceptanceStats, int]], cfg: EvalConfig) -> dict:
    """A cell's figures from its rows (task, base stats, adapted stats, generated tokens): pooled τ of each side,
    the ratio, rows, tasks, tokens, 95% intervals over tasks, and whether it is too few to judge."""
    from dspine.stats import bootstrap_over_groups

    def merged(items) -> tuple[AcceptanceStats, AcceptanceStats]:
        b, a = items[0][1], items[0][2]
        for r in items[1:]:
            b, a = b.merge(r[1]), a.merge(r[2])
        return b, a

    def pooled(items) -> dict:
        b, a = merged(items)
        return {"base": b.tau, "adapted": a.tau, "ratio": a.tau / b.tau if b.tau else 0.0}

    by_task: dict[str, list] = {}
    for r in rows:
        by_task.setdefault(r[0], []).append(r)
    b, a = merged(rows)
    ci = bootstrap_over_groups(list(by_task.values()), pooled, cfg.draws)
    return {
        "base": b.tau,
        "adapted": a.tau,
        "ratio": a.tau / b.tau,
        "base_ci": ci["base"],
        "adapted_ci": ci["adapted"],
        "ratio_ci": ci["ratio"],
        "rows": len(rows),
        "tasks": len(by_task),
        "tokens": sum(r[3] for r in rows),
        "too_few": len(rows) < cfg.min_rows or len(by_task) < cfg.min_tasks,
        "rounds": {"base": b.rounds, "adapted": a.rounds},
        "per_slot": {"base": b.per_slot, "adapted": a.per_slot},
    }


def evaluate_adaptation(cfg: EvalConfig, progress: bool = True) -> dict:
    """Replay every group's held-out rows with the base and its adapted drafter, run the general benchmarks,
    gate -> the document (written to cfg.out, with a Markdown table beside it)."""
    import torch

    from dspine.adapt.finetuning import group_of
    from dspine.agents.traces import load_traces
    from dspine.checkpoint import load_drafter, resolve_drafter
    from dspine.eval.acceptance import benchmark_means, evaluate
    from dspine.eval.replay import replay
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
        res = replay(
            target,
            {"base": base, g: adapted},
            jobs,
            progress=progress,
            batch_size=cfg.batch_size,
            prefix_tokens=cfg.prefix_cache_tokens,
        )
        cells: dict[str, list] = {}
        for k, row in enumerate(grows):
            b, a = (AcceptanceStats(r["block_size"], r["accept_hist"]) for r in res[2 * k : 2 * k + 2])
            task = f"{row['workload']}:{row['task_id']}"
            cells.setdefault(cell_of(row), []).append((task, b, a, len(row["completion_token_ids"])))
        for key, crow in cells.items():
            per_cell[key] = {**cell_figures(crow, cfg), "drafter": g}
        _mark_levels(per_cell, grows, target)
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
            "regression_ci": {g: regression_interval(ev["results"], g, cfg.draws) for g in drafters},
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
    cis = [c for c in (general or {}).get("regression_ci", {}).values() if c]
    doc["general_regression_ci"] = max(cis, key=lambda c: c[1]) if cis else None
    doc["split"] = ",".join(sorted({d.get("split", "episode") for d in drafters.values()})) or None
    doc["gate"] = gate(doc, cfg.min_ratio, cfg.max_general_regression, cfg.max_general_regression_upper)
    if pending:
        doc["gate"] = {g: {"accept": False, "reasons": ["general benchmarks pending"]} for g in drafters}
    doc["thresholds"] = {
        "min_ratio": cfg.min_ratio,
        "max_general_regression": cfg.max_general_regression,
        "max_general_regression_upper": cfg.max_general_regression_upper,
        "min_rows": cfg.min_rows,
        "min_tasks": cfg.min_tasks,
    }
    doc.update(provenance())
    if cfg.out:
        atomic_write_text(cfg.out, json.dumps(doc, indent=1))
        atomic_write_text(Path(cfg.out).with_suffix(".md"), markdown(doc))
    return doc


def regression_interval(results: dict, name: str, draws: int = 2000) -> list[float] | None:
    """95% interval of 1 − mean τ(adapted) / mean τ(base) over the benchmarks, each benchmark's items resampled
    (base and adapted paired on the same items). None when the results carry no per-item τ."""
    import random

    per = {}
    for bench, by_t in results.items():
        cell = by_t.get("T0", {})
        b, a = cell.get("base", {}).get("per_request_tau"), cell.get(name, {}).get("per_request_tau")
        if not b or not a or len(b) != len(a):
            return None
        per[bench] = list(zip(b, a))
    rng, vals = random.Random(0), []
    for _ in range(draws):
        mb = ma = 0.0
        for pairs in per.values():
            pick = rng.choices(pairs, k=len(pairs))
            mb += sum(p[0] for p in pick) / len(pick)
            ma += sum(p[1] for p in pick) / len(pick)
        vals.append(1 - ma / mb)
    vals.sort()
    return [vals[int(0.025 * draws)], vals[int(0.975 * draws) - 1]]


def _mark_levels(per_cell: dict, rows: list[dict], target) -> None:
    """On a target without a thinking mode, a workload's cells at several levels replay the same conversations
    with a system note apart: each such cell names the others (`same_prompts_as`)."""
    from dspine.target import has_thinking_mode

    if has_thinking_mode(target.info.model_type):  # the levels differ
        return
    levels: dict[str, set[str]] = {}
    for r in rows:
        levels.setdefault(r["workload"], set()).add(r["thinking"])
    for w, lv in levels.items():
        if len(lv) > 1:
            for x in lv:
                if f"{w}/{x}" in per_cell:
                    per_cell[f"{w}/{x}"]["same_prompts_as"] = sorted(f"{w}/{y}" for y in lv if y != x)


def summary_section(doc: dict) -> dict:
    keep = ("general_regression", "general_regression_ci", "min_ratio", "split", "git_sha", "command", "hardware")
    fields = ("base", "adapted", "ratio", "ratio_ci", "rows", "tasks", "tokens", "too_few")
    cells = {c: {k: v.get(k) for k in fields} for c, v in doc["per_cell"].items()}
    return {"per_cell": cells, **{k: doc.get(k) for k in keep}}


def cells_table(doc: dict) -> str:
    """Per cell: rows, tasks, tokens, τ base / adapted / ratio with their intervals (Markdown), and the note on
    cells whose levels replay the same prompts."""
    from dspine.io import md_table

    def ci(v) -> str:
        return f" ({v[0]:.2f}–{v[1]:.2f})" if v else ""

    rows = [
        [
            c + (" ¹" if v.get("same_prompts_as") else ""),
            v["drafter"],
            v["rows"],
            v.get("tasks", "?"),
            v.get("tokens", "?"),
            f"{v['base']:.3f}{ci(v.get('base_ci'))}",
            f"{v['adapted']:.3f}{ci(v.get('adapted_ci'))}",
            f"{v['ratio']:.3f}{ci(v.get('ratio_ci'))}" + (" — too few" if v.get("too_few") else ""),
        ]
        for c, v in sorted(doc["per_cell"].items())
    ]
    head = ["workload/level", "drafter", "rows", "tasks", "tokens", "τ base (95% CI)", "τ adapted", "ratio"]
    text = md_table(head, rows)
    if any(v.get("same_prompts_as") for v in doc["per_cell"].values()):
        text += (
            "\n\n¹ the target has no thinking mode: its levels are a system note, so these cells replay the same "
            "conversations and are not separate measurements"
        )
    return text


def markdown(doc: dict) -> str:
    text = f"# Adaptation: test rows replayed (exact token prefixes), split by {doc.get('split') or 'episode'}\n\n"
    text += cells_table(doc)
    if doc.get("general"):
        g = doc["general"]
        text += f"\n\nGeneral benchmarks (T = 0, {g['limit']} items each): τ " + ", ".join(
            f"{n} {t:.3f}" for n, t in g["tau_mean"].items()
        )
        text += "; regression " + ", ".join(
            f"{n} {r:+.1%}"
            + (f" (95% CI {c[0]:+.1%} to {c[1]:+.1%})" if (c := g.get("regression_ci", {}).get(n)) else "")
            for n, r in g["regression"].items()
        )
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
