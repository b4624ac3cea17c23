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
import time
from pathlib import Path

import torch

from dspine.checkpoint import config_to_json, load_models
from dspine.decoding import DraftTree
from dspine.engine import Engine
from dspine.io import atomic_write_text, json_text, md_table, provenance
from dspine.plots import line_panels
from dspine.sampling import SamplingParams
from dspine.stats import AcceptanceStats, group_by, summarize
from dspine.workloads import load_benchmark


def temperature_key(T: float) -> str:
    """How a temperature is keyed in evaluation documents ("T0", "T0.7"); `temperatures` maps keys back."""
    return f"T{T:g}"


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


def eval_item(engines: dict, item, temperatures: list[float], max_new_tokens: int, seed: int) -> dict:
    """One benchmark item through every engine at every temperature -> {"T0": {method: (tokens, stats, s)}}."""
    out = {}
    for T in temperatures:
        cell = {}
        for name, eng in engines.items():
            t0 = time.perf_counter()
            toks, stats = run_item(eng, item.turns, SamplingParams(max_tokens=max_new_tokens, temperature=T, seed=seed))
            cell[name] = (toks, stats, time.perf_counter() - t0)
        out[temperature_key(T)] = cell
    return out


def evaluate(
    target,
    drafters: dict,
    benchmarks: list[str],
    limit: int,
    temperatures: list[float],
    max_new_tokens: int,
    seed: int = 0,
    progress: bool = True,
    workers: int = 1,
    target_spec: tuple | None = None,
    drafter_paths: dict | None = None,
    max_turns: int | None = None,
    trees: dict | None = None,
    suffix: set | None = None,
) -> dict:
    """drafters: name -> DSpineDraftModel. Returns {"results": {bench: {"T0": {method: {...}}}}, ...}.

    workers > 1 runs items in that many processes (the engine is batch-1 and launch-bound, so on a GPU
    several processes share it well; with several GPUs visible they spread over them); they rebuild the
    models from `target_spec` = (spec, dtype, device) and `drafter_paths` (name -> checkpoint folder, or
    (folder, decode knobs): `load_at`). Results are
    identical to workers=1. `max_turns` asks only the first turns of multi-turn items (MT-Bench) — what a
    single-turn server benchmark sends. `trees`: name -> draft tree (a decoding.DraftTree or its spec) for drafters
    whose rounds verify a tree instead of the chain of block_size - 1 drafts. `suffix`: the names whose engines
    draft with suffix drafting too (their drafter None: suffix drafting alone; engine.Engine's `suffix`).
    """
    import dataclasses

    from tqdm.auto import tqdm

    trees = check_trees(drafters, trees)
    units = [
        (b, i, dataclasses.replace(it, turns=it.turns[:max_turns]) if max_turns else it)
        for b in benchmarks
        for i, it in enumerate(load_benchmark(b, limit))
    ]
    per_item: dict = {}
    bar = tqdm(total=len(units), desc="eval", disable=not progress)
    if workers <= 1:
        engines = _engines(target, drafters, trees, suffix)
        for b, i, it in units:
            per_item[b, i] = eval_item(engines, it, temperatures, max_new_tokens, seed + i)
            bar.update(1)
    else:
        import concurrent.futures as cf

        with worker_pool(workers, target_spec, drafter_paths, trees, suffix) as pool:
            futs = {pool.submit(_worker_item, it, temperatures, max_new_tokens, seed + i): (b, i) for b, i, it in units}
            for f in cf.as_completed(futs):
                per_item[futs[f]] = f.result()
                bar.update(1)
    bar.close()
    results = {}
    for bench in benchmarks:
        n = sum(1 for b, _, _ in units if b == bench)
        results[bench] = {}
        for T in temperatures:
            key = temperature_key(T)
            rows = [per_item[bench, i][key] for i in range(n)]
            cell = {
                "ar": {
                    "tau_mean": 1.0,
                    "tau_pooled": 1.0,
                    "requests": n,
                    "tokens": sum(len(r["ar"][0]) for r in rows),
                    "seconds": sum(r["ar"][2] for r in rows),
                }
            }
            for name in drafters:
                cell[name] = {
                    **summarize([r[name][1] for r in rows]),
                    "per_request_tau": [r[name][1].tau for r in rows],  # for intervals over items
                    "tokens": sum(len(r[name][0]) for r in rows),
                    "seconds": sum(r[name][2] for r in rows),
                }
                if T == 0:
                    match = sum(r[name][0] == r["ar"][0] for r in rows)
                    cell[name]["exact_match"] = {"matched": match, "requests": n}
                    cell[name]["exact_match_with_ar"] = f"{match}/{n}"  # the same, for reading
            results[bench][key] = cell
    return {
        "results": results,
        "means": benchmark_means(results),
        "temperatures": {temperature_key(T): T for T in temperatures},
        **provenance(),
        "config_hashes": {n: config_hash(d) for n, d in drafters.items() if d is not None},
        "limit": limit,
        "max_new_tokens": max_new_tokens,
        "target": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "workers": workers,
        "max_turns": max_turns,
        "draft_trees": {n: str(t) for n, t in trees.items()},
        "suffix_drafting": sorted(suffix or []),
    }


def check_trees(drafters: dict, trees: dict | None) -> dict[str, DraftTree]:
    """name -> tree (or its spec) -> name -> DraftTree, each for a named drafter that can draft it (ValueError
    naming the problem otherwise)."""
    out = {}
    for name, spec in (trees or {}).items():
        if name not in drafters or drafters[name] is None:
            raise ValueError(
                f"draft tree for {name!r}: no model drafter of that name (drafters: {', '.join(drafters)})"
            )
        try:
            out[name] = DraftTree.for_drafter(spec, drafters[name].config)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return out


def _engines(target, drafters: dict, trees: dict | None = None, suffix: set | None = None) -> dict[str, Engine]:
    """AR's engine and each drafter's (through its draft tree where `trees` names one; with suffix drafting for the
    names in `suffix`)."""
    from dspine.suffix import SuffixConfig

    trees, suffix = trees or {}, suffix or set()
    cfg = lambda n: SuffixConfig() if n in suffix else None
    return {
        "ar": Engine(target),
        **{n: Engine(target, d, tree=trees.get(n), suffix=cfg(n)) for n, d in drafters.items()},
    }


def worker_pool(
    workers: int, target_spec: tuple | None, drafter_paths: dict | None, trees: dict | None = None, suffix=None
):
    """`workers` spawned processes, each with the target and the drafters loaded once (and its share of the CPU's
    threads): the pool `evaluate` and `replay.replay` hand items to."""
    import concurrent.futures as cf
    import multiprocessing as mp

    if target_spec is None or drafter_paths is None:
        raise ValueError("parallel evaluation needs target_spec and drafter_paths")
    threads = max(1, (torch.get_num_threads() if target_spec[2] == "cpu" else 2 * workers) // workers)
    ctx = mp.get_context("spawn")
    return cf.ProcessPoolExecutor(
        workers,
        mp_context=ctx,
        initializer=_worker_init,
        initargs=(target_spec, drafter_paths, threads, ctx.Value("i", 0), trees, suffix),
    )


_ENGINES: dict = {}


def _worker_init(
    target_spec: tuple, drafter_paths: dict, threads: int, counter, trees: dict | None = None, suffix=None
) -> None:
    """Load the models once per worker; with device "cuda" and several visible GPUs, worker i takes GPU
    i mod count (the requests are independent, so any spread gives the same results)."""
    torch.set_num_threads(threads)
    spec, dtype, device = target_spec
    with counter.get_lock():
        index, counter.value = counter.value, counter.value + 1
    if device == "cuda" and torch.cuda.device_count() > 1:
        torch.cuda.set_device(index % torch.cuda.device_count())
    target, drafters = load_models(spec, dtype, device, drafter_paths)
    _ENGINES.update(_engines(target, drafters, trees, suffix))


def _worker_item(item, temperatures, max_new_tokens, seed):
    return eval_item(_ENGINES, item, temperatures, max_new_tokens, seed)


def worker_replay(name, prompt_ids, forced):
    from dspine.eval.replay import replay_one

    return replay_one(_ENGINES, name, prompt_ids, forced)


def benchmark_means(results: dict) -> dict:
    """Mean over benchmarks of each method's tau_mean, per temperature."""
    out: dict = {}
    for by_t in results.values():
        for key, cell in by_t.items():
            for name, r in cell.items():
                out.setdefault(key, {}).setdefault(name, []).append(r["tau_mean"])
    return {k: {n: sum(v) / len(v) for n, v in d.items()} for k, d in out.items()}


def _label(doc: dict, key: str) -> str:
    """A temperature key as written in tables ("T = 0"), from the document's key -> temperature map."""
    t = doc.get("temperatures", {}).get(key)
    return key if t is None else f"T = {t:g}"


def markdown_table(doc: dict) -> str:
    results, means = doc["results"], doc["means"]
    methods = list(next(iter(next(iter(results.values())).values())).keys())
    lines = []
    for key in temperatures(doc):
        lines.append(f"\n**{_label(doc, key)}** (τ = mean of per-request acceptance lengths)\n")
        rows = [
            [m, *(f"{results[b][key][m]['tau_mean']:.3f}" for b in results), f"{means[key][m]:.3f}"] for m in methods
        ]
        lines.append(md_table(["method", *results, "mean"], rows))
        trees = ["", *(f"_{m[len('dspine_') :]}" for m in doc.get("draft_trees", {}) if m.startswith("dspine_"))]
        for a, b in (("dspine", "dflash"), ("dspine", "post_backbone")):
            for t in trees:  # the chain, then each tree both were decoded through
                if a + t in methods and b + t in methods:
                    lines.append(f"\nτ({a + t}) / τ({b + t}) at {key}: {means[key][a + t] / means[key][b + t]:.3f}")
        for m in methods:
            em = [results[b][key][m].get("exact_match") for b in results]
            if all(em):
                ok, n = sum(e["matched"] for e in em), sum(e["requests"] for e in em)
                lines.append(f"\n{m}: exact match with AR on {ok}/{n} requests at {key}")
    for m, tree in doc.get("draft_trees", {}).items():
        lines.append(f"\n{m}: rounds verify the draft tree {tree} (τ per target forward; the others a chain)")
    lines.append(slot_table(doc))
    rep = doc.get("train_report", {}).get("methods")
    if rep:
        steps = doc["train_report"].get("train", {}).get("steps", "?")
        lines.append(f"\n**Held-out simulated τ** (all drafters trained in lockstep, {steps} steps)\n")
        rows = []
        for n, r in rep.items():
            over = ", ".join(f"{k}={v}" for k, v in {**r.get("drafter", {}), **r.get("loss", {})}.items()) or "—"
            rows.append([n, r.get("method", n), over, f"{r['tau_sim_before']:.3f}", f"{r['best_tau_sim']:.3f}"])
        lines.append(md_table(["drafter", "method", "overrides", "τ_sim before", "τ_sim best"], rows))
    return "\n".join(lines) + "\n"


SLOTS_SHOWN = 8  # later slots are rarely reached at the τ seen here


def temperatures(doc: dict) -> list[str]:
    """The temperature keys ("T0", "T1", ...) of an evaluation document."""
    return sorted({k for b in doc["results"].values() for k in b})


def pooled_slots(doc: dict, key: str) -> dict[str, dict]:
    """Each drafter's rounds at temperature `key`, pooled over the benchmarks (stats.group_by by method)."""
    return group_by(
        (m, AcceptanceStats(len(r["accept_hist"]), r["accept_hist"]))
        for bench in doc["results"].values()
        for m, r in bench.get(key, {}).items()
        if r.get("accept_hist")
    )


def slot_table(doc: dict) -> str:
    lines = []
    for key in temperatures(doc):
        pooled = pooled_slots(doc, key)
        if not pooled:
            continue
        n = min(SLOTS_SHOWN, *(len(g["per_slot"]) for g in pooled.values()))
        lines.append(
            f"\n**Per-slot acceptance at {_label(doc, key)}**, pooled over the benchmarks: "
            "P(slot k accepted), and in brackets P(slot k accepted | slot k−1 accepted)\n"
        )
        rows = [
            [m, *(f"{a:.3f} ({c:.2f})" for a, c in zip(g["per_slot"][:n], g["per_slot_conditional"][:n]))]
            for m, g in pooled.items()
        ]
        lines.append(md_table(["method", *(f"slot {k}" for k in range(1, n + 1))], rows))
    return "\n".join(lines) + "\n" if lines else ""


def slot_chart(doc: dict) -> str | None:
    """SVG: per temperature, P(slot k accepted) and P(slot k | slot k-1) for every drafter (None: no drafter)."""
    panels = []
    for key in temperatures(doc):
        pooled = pooled_slots(doc, key)
        if pooled:
            t = _label(doc, key)
            panels.append((f"P(slot k accepted), {t}", {m: g["per_slot"][:SLOTS_SHOWN] for m, g in pooled.items()}))
            panels.append(
                (
                    f"P(slot k | slot k-1 accepted), {t}",
                    {m: g["per_slot_conditional"][:SLOTS_SHOWN] for m, g in pooled.items()},
                )
            )
    return line_panels(panels, "block slot k") if panels else None


def write_results(doc: dict, out: str | Path) -> Path:
    """JSON, a Markdown table and an SVG chart of per-slot acceptance beside it (temp files, then renames)."""
    out = Path(out)
    atomic_write_text(out, json_text(doc))
    atomic_write_text(out.with_suffix(".md"), markdown_table(doc))
    chart = slot_chart(doc)
    if chart:
        atomic_write_text(out.with_suffix(".svg"), chart)
    return out
