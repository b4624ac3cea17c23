"""Adaptation variants side by side: each variant's `adapt/evaluate.py` document (the same traces, the same split by
task, the same test rows) in one table — per workload × level cell the adapted τ and the ratio with its interval,
the general regression with its interval, the gate's verdict — and the collection the traces came from.

    python bench/experiments/adapt_ablation.py --variant "max_len 2048=runs/adapt_base.json" \\
        --variant "max_len 4096=runs/adapt_ctx4k.json" --traces runs/replay \\
        --out bench/results/adapt_ablation.json

`--traces` summarises the collection (per workload conversations, tasks, turns, generated tokens, mean prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspine.io import atomic_write_text, json_text, md_table, provenance


def collection(traces: str) -> dict:
    from dspine.agents.traces import load_traces

    rows = load_traces(traces).to_pylist()
    out = {}
    for w in sorted({r["workload"] for r in rows}):
        rs = [r for r in rows if r["workload"] == w]
        out[w] = {
            "conversations": len({r["episode_id"] for r in rs}),
            "tasks": len({r["task_id"] for r in rs}),
            "turns": len(rs),
            "tokens": sum(r["completion_tokens"] for r in rs),
            "prompt_tokens_mean": round(sum(r["prompt_tokens"] for r in rs) / len(rs), 1),
        }
    return out


def variant_row(name: str, doc: dict) -> dict:
    keep = ("drafter", "rows", "tasks", "tokens", "base", "adapted", "ratio", "ratio_ci", "too_few")
    return {
        "variant": name,
        "cells": {cell: {k: c.get(k) for k in keep} for cell, c in doc["per_cell"].items()},
        "min_ratio": doc["min_ratio"],
        "general_regression": doc["general_regression"],  # the worst drafter's
        "general_regression_ci": doc["general_regression_ci"],
        "gate": doc["gate"],
    }


def table(doc: dict) -> str:
    cells = sorted({c for v in doc["variants"] for c in v["cells"]})
    head = [
        "variant",
        *[f"{c} ratio (95% CI)" for c in cells],
        "general regression (95% CI)",
        "gate",
        "validation τ_sim",
    ]
    rows = []
    for v in doc["variants"]:
        row = [v["variant"] + (f" ({v['git_sha'][:7]})" if v.get("git_sha") else "")]
        for c in cells:
            x = v["cells"].get(c)
            row.append(f"{x['ratio']:.3f} ({x['ratio_ci'][0]:.2f}–{x['ratio_ci'][1]:.2f})" if x else "—")
        g, ci = v["general_regression"], v["general_regression_ci"]
        row.append(f"{100 * g:+.1f}% ({100 * ci[0]:+.1f}% to {100 * ci[1]:+.1f}%)")
        row.append("; ".join(f"{k}: {'accept' if x['accept'] else 'refuse'}" for k, x in v["gate"].items()))
        val = v.get("validation_tau_sim") or {}
        row.append(", ".join(f"{g} {t:.2f}" for g, t in val.items() if t is not None) or "—")
        rows.append(row)
    first = doc["variants"][0]["cells"]
    sizes = ", ".join(f"{c}: {x['rows']} test rows, {x['tasks']} tasks, {x['tokens']} tokens" for c, x in first.items())
    text = md_table(head, rows) + f"\n\nTest part (every variant): {sizes}.\n"
    if doc.get("collection"):
        col = doc["collection"]
        text += "\nCollection: " + "; ".join(
            f"{w} {c['conversations']} conversations, {c['tasks']} tasks, {c['turns']} turns, {c['tokens']} tokens, "
            f"prompts {c['prompt_tokens_mean']:.0f} tokens on average"
            for w, c in col.items()
        )
        text += ".\n"
    if doc.get("recipe"):
        text += f"\nRecipe: {doc['recipe']}\n"
    return text + f"\n{doc['git_sha'][:7]} · {doc['hardware']} · `{doc['command']}`\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True, help="NAME=PATH of an adapt/evaluate.py JSON")
    p.add_argument("--traces", help="the collection directory the variants were fine-tuned on")
    p.add_argument("--hardware", help="where the variants ran (default: their documents' hardware)")
    p.add_argument("--recipe", default="", help="how the variants were made (the commands), printed under the table")
    p.add_argument(
        "--validation",
        action="append",
        default=[],
        help="NAME=PATH of a variant's finetune.json: its validation τ_sim (what picked its checkpoint and blend) "
        "goes beside its test figures",
    )
    p.add_argument(
        "--earlier",
        help="an earlier adapt_ablation JSON on the same traces and split: its variants are kept first, each with "
        "the git sha it ran at",
    )
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    docs = []
    for v in a.variant:
        name, _, path = v.partition("=")
        if not path:
            p.error(f"--variant {v!r}: NAME=PATH")
        docs.append((name, json.loads(Path(path).read_text())))
    rows = [variant_row(n, d) for n, d in docs]
    for v in a.validation:
        name, _, path = v.partition("=")
        row = next((r for r in rows if r["variant"] == name), None)
        if row is None or not path:
            p.error(f"--validation {v!r}: NAME=PATH with NAME one of the --variant names")
        groups = json.loads(Path(path).read_text())["groups"]
        row["validation_tau_sim"] = {g: x["last"].get("eval_tau_sim") for g, x in groups.items()}
    if a.earlier:
        before = json.loads(Path(a.earlier).read_text())
        rows = [{**v, "git_sha": v.get("git_sha", before["git_sha"])} for v in before["variants"]] + rows
    doc = {
        **provenance(),
        "hardware": a.hardware or docs[0][1].get("hardware"),
        "variants": rows,
        "collection": collection(a.traces) if a.traces else {},
        "recipe": a.recipe,
    }
    out = Path(a.out)
    atomic_write_text(out, json_text(doc))
    atomic_write_text(out.with_suffix(".md"), table(doc))
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
