"""`dspine eval`: acceptance per benchmark through the real engine (not a simulation).

For every benchmark × temperature × method (AR plus any set of drafters) each item is decoded turn by turn
(MT-Bench's second turn follows the target's own first reply); a request's acceptance is the merge of its
turns. At temperature 0 every drafter's output is compared with AR's token for token: the exact-match count
is part of the result (any mismatch is a bug). Output: one JSON document (git sha, command, hardware,
config hashes) and a Markdown table.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from workloads import load_benchmark

from .checkpoint import config_to_json
from .engine import Engine
from .io import atomic_write_text
from .sampling import SamplingParams
from .stats import AcceptanceStats, summarize


def git_sha() -> str:
    """The checkout's commit; DSPINE_GIT_SHA where the tree travels without its history (the GPU machine)."""
    import os
    import re

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        sha = ""
    return sha if re.fullmatch(r"[0-9a-f]{40}", sha) else os.environ.get("DSPINE_GIT_SHA", "unknown")


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({platform.node()})"
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} ({platform.node()})"


def config_hash(drafter) -> str:
    blob = json.dumps(config_to_json(drafter.config), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def run_item(engine: Engine, turns: list[str], params: SamplingParams) -> tuple[list[int], AcceptanceStats | None]:
    messages, tokens, stats = [], [], None
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        res = engine.generate(messages, params)
        messages.append({"role": "assistant", "content": res.text})
        tokens += res.token_ids
        if res.stats is not None:
            stats = res.stats if stats is None else stats.merge(res.stats)
    return tokens, stats


def evaluate(target, drafters: dict, benchmarks: list[str], limit: int, temperatures: list[float],
             max_new_tokens: int, seed: int = 0, progress: bool = True) -> dict:
    """drafters: name -> DSpineDraftModel. Returns {"results": {bench: {"T0": {method: {...}}}}, ...}."""
    from tqdm.auto import tqdm

    engines = {"ar": Engine(target), **{n: Engine(target, d) for n, d in drafters.items()}}
    results: dict = {}
    total = sum(len(load_benchmark(b, limit)) for b in benchmarks) * len(temperatures) * len(engines)
    bar = tqdm(total=total, desc="eval", disable=not progress)
    for bench in benchmarks:
        items = load_benchmark(bench, limit)
        results[bench] = {}
        for T in temperatures:
            key = f"T{T:g}"
            cell: dict = {}
            ar_tokens: list[list[int]] = []
            for name, eng in engines.items():
                t0 = time.perf_counter()
                per_req, match, ntok = [], 0, 0
                for i, item in enumerate(items):
                    params = SamplingParams(max_tokens=max_new_tokens, temperature=T, seed=seed + i)
                    toks, stats = run_item(eng, item.turns, params)
                    ntok += len(toks)
                    if name == "ar":
                        ar_tokens.append(toks)
                    else:
                        per_req.append(stats)
                        match += toks == ar_tokens[i]
                    bar.update(1)
                secs = time.perf_counter() - t0
                if name == "ar":
                    cell[name] = {"tau_mean": 1.0, "tau_pooled": 1.0, "requests": len(items), "tokens": ntok,
                                  "seconds": secs}
                else:
                    s = summarize(per_req)
                    cell[name] = {**s, "tokens": ntok, "seconds": secs}
                    if T == 0:
                        cell[name]["exact_match_with_ar"] = f"{match}/{len(items)}"
            results[bench][key] = cell
    bar.close()
    return {"results": results, "means": benchmark_means(results), "git_sha": git_sha(), "hardware": hardware(),
            "command": " ".join(sys.argv), "config_hashes": {n: config_hash(d) for n, d in drafters.items()},
            "limit": limit, "max_new_tokens": max_new_tokens, "target": target.name,
            "dtype": str(target.dtype).replace("torch.", "")}


def benchmark_means(results: dict) -> dict:
    """Mean over benchmarks of each method's tau_mean, per temperature."""
    out: dict = {}
    for bench, by_t in results.items():
        for key, cell in by_t.items():
            for name, r in cell.items():
                out.setdefault(key, {}).setdefault(name, []).append(r["tau_mean"])
    return {k: {n: sum(v) / len(v) for n, v in d.items()} for k, d in out.items()}


def markdown_table(doc: dict) -> str:
    results, means = doc["results"], doc["means"]
    temps = sorted({k for b in results.values() for k in b})
    methods = list(next(iter(next(iter(results.values())).values())).keys())
    lines = []
    for key in temps:
        lines.append(f"\n**{key.replace('T', 'T = ')}** (τ = mean of per-request acceptance lengths)\n")
        lines.append("| method | " + " | ".join(results) + " | mean |")
        lines.append("|---" * (len(results) + 2) + "|")
        for m in methods:
            row = [f"{results[b][key][m]['tau_mean']:.3f}" for b in results]
            lines.append(f"| {m} | " + " | ".join(row) + f" | {means[key][m]:.3f} |")
        ratios = [(a, b) for a, b in (("dspine", "dflash"), ("dspine", "post_backbone")) if a in methods and b in methods]
        for a, b in ratios:
            lines.append(f"\nτ({a}) / τ({b}) at {key}: {means[key][a] / means[key][b]:.3f}")
        for m in methods:
            em = [results[b][key][m].get("exact_match_with_ar") for b in results]
            if all(em):
                ok = sum(int(x.split('/')[0]) for x in em)
                n = sum(int(x.split('/')[1]) for x in em)
                lines.append(f"\n{m}: exact match with AR on {ok}/{n} requests at {key}")
    return "\n".join(lines) + "\n"


def write_results(doc: dict, out: str | Path) -> Path:
    """JSON + a Markdown table beside it (temp files, then renames)."""
    out = Path(out)
    atomic_write_text(out, json.dumps(doc, indent=1) + "\n")
    atomic_write_text(out.with_suffix(".md"), markdown_table(doc))
    return out
