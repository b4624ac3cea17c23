"""Acceptance at T = 0 by replay: the target answers once, greedily, and every drafter is replayed on exactly that
text (`Engine.generate(forced=...)`), so τ differences are the drafters' own, for a fraction of decoding every
drafter (what speculative decoding at T = 0 accepts, since its output is that answer). Benchmarks and grouped
answers, pairs' ratios with bootstrap intervals over items, several seeds combined, resumable under a deadline
through a cache keyed by the drafters' weights; the Markdown and SVG of such a document.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from dspine.engine import Engine, generate_batch
from dspine.eval.acceptance import SLOTS_SHOWN, config_hash, worker_pool, worker_replay
from dspine.io import atomic_write_text, json_text, md_table, provenance
from dspine.plots import line_panels
from dspine.prefix import PrefixCache
from dspine.sampling import SamplingParams
from dspine.stats import AcceptanceStats, summarize
from dspine.workloads import load_benchmark


def replay(
    target,
    drafters: dict,
    jobs: list[tuple[str, list[int], list[int]]],
    progress: bool = True,
    workers: int = 1,
    target_spec: tuple | None = None,
    drafter_paths: dict | None = None,
    batch_size: int = 1,
    prefix_tokens: int = 0,
) -> list[dict]:
    """jobs: (drafter name, prompt ids, a greedy continuation from elsewhere, e.g. SGLang's) -> per job the
    drafter's acceptance on exactly that text (`Engine.generate(forced=...)`): {"tau", "rounds", "accepted"}.
    Trajectories no longer diverge, so τ differences are the drafters' own (kernels, numerics). Workers as
    in `evaluate`; `batch_size` > 1 (one process) replays that many jobs of one drafter together, by prompt
    length (`BatchDecode` with forced rows), the way a GPU is kept busy. `prefix_tokens` > 0 (one process):
    every drafter's engine shares one prefix cache of that many tokens (prefix.PrefixCache: the target's K/V
    and features, not the drafter's) and each batch of prompts goes through every drafter before the next, so a
    prompt replayed by several drafters — or extended by a later turn of its conversation — is prefilled once;
    the drafters then read the very features the first prefill computed."""
    import concurrent.futures as cf

    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), desc="replay", disable=not progress)
    out: list = [None] * len(jobs)
    shared = PrefixCache(prefix_tokens) if prefix_tokens > 0 and workers <= 1 else None
    engines = {n: Engine(target, d, prefix_cache=shared) for n, d in drafters.items()} if workers <= 1 else {}
    if workers <= 1 and batch_size > 1:
        # each drafter's jobs longest prompt first (ties by the prompt itself, so that drafters replaying the
        # same prompts batch them alike); batch k of every drafter before batch k + 1 of any
        order = {
            name: sorted((i for i, j in enumerate(jobs) if j[0] == name), key=lambda i: (-len(jobs[i][1]), jobs[i][1]))
            for name in engines
        }
        for k in range(0, max(map(len, order.values()), default=0), batch_size):
            for name, eng in engines.items():
                chunk = order[name][k : k + batch_size]
                if not chunk:
                    continue
                prompts, texts = [jobs[i][1] for i in chunk], [jobs[i][2] for i in chunk]
                res = generate_batch(eng, prompts, SamplingParams(temperature=0.0), forced=texts)
                for i, r in zip(chunk, res):
                    out[i] = _stats_of(r.stats)
                bar.update(len(chunk))
    elif workers <= 1:
        for i, job in enumerate(jobs):
            out[i] = replay_one(engines, *job)
            bar.update(1)
    else:
        with worker_pool(workers, target_spec, drafter_paths) as pool:
            futs = {pool.submit(worker_replay, *job): i for i, job in enumerate(jobs)}
            for f in cf.as_completed(futs):
                out[futs[f]] = f.result()
                bar.update(1)
    bar.close()
    return out


def greedy_answers(target, turns: list[str], max_new_tokens: int, batch_size: int = 32) -> list[tuple[list, list]]:
    """Each user turn rendered as the engine renders a request and answered greedily by the target alone, in
    batches of `batch_size` -> [(prompt ids, answer ids)]: the text every drafter is then replayed on."""
    prompts = [Engine(target, None).prompt_ids(t) for t in turns]
    return list(zip(prompts, greedy_completions(target, prompts, max_new_tokens, batch_size)))


def greedy_completions(target, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 32) -> list[list]:
    """Each prompt (token ids) answered greedily by the target alone, `batch_size` at a time -> answer ids."""
    eng, params, out = Engine(target, None), SamplingParams(max_tokens=max_new_tokens, temperature=0.0), []
    for k in range(0, len(prompts), batch_size):
        out += [list(r.token_ids) for r in generate_batch(eng, prompts[k : k + batch_size], params)]
    return out


class ReplayIncomplete(RuntimeError):
    """A replay evaluation stopped at its deadline: `done` of `total` drafters are kept in its cache folder, and
    the same call again goes on from there."""

    def __init__(self, done: int, total: int, cache: Path | None):
        kept = f"kept in {cache}: run the same evaluation again to go on" if cache else "nothing kept (no cache)"
        super().__init__(f"replayed {done} of {total} drafters before the deadline; {kept}")
        self.done, self.total, self.cache = done, total, cache


def weights_digest(module) -> str:
    """A digest of a module's configuration and every parameter's bytes: a cached replay belongs to exactly these
    weights (a drafter trained further keeps its config hash but not this)."""
    h = hashlib.sha256(config_hash(module).encode() if hasattr(module, "config") else b"")
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().to("cpu").reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _cached(path: Path | None, key: dict):
    """The value kept at `path` under exactly `key`, else None (absent, unreadable or another key)."""
    if path is None or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc.get("value") if doc.get("key") == key else None


def _keep(path: Path | None, key: dict, value) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, "value": value}))


def replay_benchmarks(
    target,
    drafters: dict,
    benchmarks: list[str],
    limit: int,
    max_new_tokens: int,
    batch_size: int = 32,
    progress: bool = True,
    cache: str | Path | None = None,
    deadline: float | None = None,
) -> dict:
    """Acceptance at T = 0 on identical text: each benchmark item's first turn answered greedily by the target
    once, then every drafter replayed on exactly that answer (`replay`, batched) — what speculative decoding
    at T = 0 accepts, since its output is that answer (round for round; in the last round only the drafts inside
    the answer count, where decoding also counts those past the token limit), for a fraction of decoding every
    drafter. Per benchmark and drafter: summarize's figures, per-item τ and (accepted, rounds); `pooled` over all
    items; `mean`: the benchmarks' pooled τ averaged.

    `cache`: a folder keeping the answers and each drafter's replay (keyed by the items, the target and the
    drafter's weights), so an evaluation cut short goes on where it stopped; `deadline` (a `time.time()`): no
    drafter's replay starts after it — `ReplayIncomplete` says how far it got."""
    cache = Path(cache) if cache is not None else None
    items = [(b, it.turns[0]) for b in benchmarks for it in load_benchmark(b, limit)]
    dtype = str(target.dtype).replace("torch.", "")
    key = {
        "benchmarks": benchmarks,
        "limit": limit,
        "max_new_tokens": max_new_tokens,
        "target": target.name,
        "dtype": dtype,
    }
    at = cache / "answers.json" if cache else None
    answers = _cached(at, key)
    if answers is None:
        answers = greedy_answers(target, [t for _, t in items], max_new_tokens, batch_size)
        _keep(at, key, answers)
    doc = replay_grouped(target, drafters, answers, [b for b, _ in items], batch_size, progress, cache, deadline)
    return {
        "mode": "replay",
        **doc,
        "items": {b: sum(1 for x, _ in items if x == b) for b in benchmarks},
        "tokens": sum(len(a) for _, a in answers),
        "limit": limit,
        "max_new_tokens": max_new_tokens,
        "target": target.name,
        "dtype": dtype,
        **provenance(),
        "config_hashes": {n: config_hash(d) for n, d in drafters.items()},
    }


def replay_grouped(
    target,
    drafters: dict,
    answers: list,
    groups: list[str],
    batch_size: int = 32,
    progress: bool = True,
    cache: Path | None = None,
    deadline: float | None = None,
) -> dict:
    """Every drafter replayed on each (prompt ids, answer ids) of `answers`, batched; `groups` labels each answer
    (its benchmark) -> {"results": {group: {drafter: summarize's figures, per-item τ and (accepted, rounds)}},
    "pooled": {drafter: over all answers}, "mean": {drafter: the groups' pooled τ averaged}}. `cache` and
    `deadline` as in `replay_benchmarks`, one drafter at a time."""
    texts = hashlib.sha256(json.dumps(answers).encode()).hexdigest()[:16] if cache else None
    per: dict = {}
    for done, (n, d) in enumerate(drafters.items()):
        path, key = None, None
        if cache:  # the digests only where something is kept under them
            path = cache / f"replay-{n}.json"
            key = {"drafter": n, "weights": weights_digest(d), "answers": texts, "target": target.name}
        res = _cached(path, key)
        if res is None:
            if deadline is not None and time.time() > deadline:
                raise ReplayIncomplete(done, len(drafters), cache)
            res = replay(target, {n: d}, [(n, p, a) for p, a in answers], progress=progress, batch_size=batch_size)
            _keep(path, key, res)
        for g, r in zip(groups, res):
            per.setdefault(g, {}).setdefault(n, []).append(AcceptanceStats(r["block_size"], r["accept_hist"]))
    results = {
        g: {
            n: {
                **summarize(sts),
                "per_request_tau": [s.tau for s in sts],
                "per_request": [[s.accepted, s.rounds] for s in sts],
            }
            for n, sts in by_name.items()
        }
        for g, by_name in per.items()
    }
    return {
        "results": results,
        "pooled": {n: summarize([s for g in per for s in per[g][n]]) for n in drafters},
        "mean": {n: sum(results[g][n]["tau_pooled"] for g in results) / len(results) for n in drafters},
    }


def pair_ratios(doc: dict, pairs: dict[str, str], draws: int = 2000) -> dict:
    """{variant: its twin} over a replay_benchmarks document -> per variant: pooled τ over all items of both,
    their ratio with a 95% bootstrap interval over items (both drafters' counts of an item resampled together),
    and the ratio of the benchmark-mean τ."""
    from dspine.stats import bootstrap_over_groups

    out = {}
    for v, twin in pairs.items():
        rows = _pair_rows(doc, v, twin)
        ci = bootstrap_over_groups([[r] for r in rows], lambda xs: {"ratio": _pooled_ratio(xs)}, draws)["ratio"]
        pv, pt = doc["pooled"][v]["tau_pooled"], doc["pooled"][twin]["tau_pooled"]
        out[v] = {
            "twin": twin,
            "tau_pooled": pv,
            "twin_tau_pooled": pt,
            "ratio_pooled": pv / pt,
            "ratio_ci": ci,
            "ratio_mean": doc["mean"][v] / doc["mean"][twin],
            "items": len(rows),
        }
    return out


def _pair_rows(doc: dict, v: str, twin: str) -> list[tuple]:
    """One (accepted, rounds) pair per item, the variant's and its twin's, in the document's item order."""
    return [
        (a, b) for bench in doc["results"].values() for a, b in zip(bench[v]["per_request"], bench[twin]["per_request"])
    ]


def _pooled_ratio(rows) -> float:
    tv = sum(a[0] + a[1] for a, _ in rows) / max(1, sum(a[1] for a, _ in rows))
    tt = sum(b[0] + b[1] for _, b in rows) / max(1, sum(b[1] for _, b in rows))
    return tv / tt if tt else 0.0


def split_seed_variants(doc: dict) -> list[dict]:
    """A replay document whose drafters include second seeds trained in the same lockstep (`NAME_s<K>` beside
    `NAME`, `DrafterSpec.seed`) -> one document per seed over the drafters every seed has, seed K's renamed to
    the base names, for `combine_seeds`; a document without such names -> [doc]."""
    names = set(doc["pooled"])
    tagged = {}
    for n in names:
        base, sep, k = n.rpartition("_s")
        if sep and k.isdigit() and base in names:
            tagged.setdefault(int(k), {})[n] = base
    if not tagged:
        return [doc]
    first_seed = ((doc.get("recipe") or {}).get("train") or {}).get("seed", 0)
    # the drafters every seed has (a variant trained under one seed only has no second to combine with)
    common = set.intersection(*(set(m.values()) for m in tagged.values()))
    seeds = [(first_seed, {n: n for n in common})]
    seeds += [(k, {n: b for n, b in m.items() if b in common}) for k, m in sorted(tagged.items())]
    out = []
    for seed, rename in seeds:
        pick = lambda d: {rename[n]: v for n, v in d.items() if n in rename}
        pairs = {
            rename[v]: {**p, "twin": rename[p["twin"]]}
            for v, p in doc.get("pairs", {}).items()
            if v in rename and p["twin"] in rename
        }
        recipe = doc.get("recipe") or {}
        out.append(
            {
                **doc,
                "results": {b: pick(r) for b, r in doc["results"].items()},
                "pooled": pick(doc["pooled"]),
                "mean": pick(doc["mean"]),
                "pairs": pairs,
                "heldout": pick(doc.get("heldout") or {}),
                "config_hashes": pick(doc.get("config_hashes") or {}),
                "recipe": {**recipe, "train": {**(recipe.get("train") or {}), "seed": seed}},
            }
        )
    return out


def combine_seeds(docs: list[dict], draws: int = 2000) -> dict:
    """Replay documents (`replay_benchmarks` + `pairs`) of one recipe trained under different seeds, on the same
    items -> one document: per pair each seed's pooled τ and ratio with its interval, and the ratio pooled over
    every seed's rows with a 95% bootstrap interval over items (an item's rows of all seeds resampled together:
    the interval is the items' spread; the seeds' spread is the per-seed ratios beside it). ValueError when the
    documents are not comparable (other items, token limits or pairs)."""
    from dspine.stats import bootstrap_over_groups

    if len(docs) < 2:
        raise ValueError(f"combine_seeds: {len(docs)} document(s); two or more seeds to combine")
    first = docs[0]
    for k, d in enumerate(docs, 1):
        if d.get("mode") != "replay" or not d.get("pairs"):
            raise ValueError(f"combine_seeds: document {k} is not a replay evaluation with pairs")
        for key in ("items", "max_new_tokens", "target"):
            if d.get(key) != first.get(key):
                raise ValueError(f"combine_seeds: document {k}'s {key} {d.get(key)!r}, the first's {first.get(key)!r}")
        twins = {v: p["twin"] for v, p in d["pairs"].items()}
        if twins != {v: p["twin"] for v, p in first["pairs"].items()}:
            raise ValueError(f"combine_seeds: document {k} pairs {twins}, the first {list(first['pairs'])}")
    seeds = [((d.get("recipe") or {}).get("train") or {}).get("seed") for d in docs]
    pairs = {}
    for v, p in first["pairs"].items():
        per_seed = [_pair_rows(d, v, p["twin"]) for d in docs]
        if len({len(r) for r in per_seed}) != 1:
            raise ValueError(f"combine_seeds: {v}: the documents hold different numbers of items")
        groups = [list(item) for item in zip(*per_seed)]  # an item's rows of every seed, resampled together
        ci = bootstrap_over_groups(groups, lambda xs: {"ratio": _pooled_ratio(xs)}, draws)["ratio"]
        pairs[v] = {
            "twin": p["twin"],
            "ratio_pooled": _pooled_ratio([r for rows in per_seed for r in rows]),
            "ratio_ci": ci,
            "per_seed": [
                {
                    k: d["pairs"][v][k]
                    for k in ("tau_pooled", "twin_tau_pooled", "ratio_pooled", "ratio_ci", "ratio_mean")
                }
                for d in docs
            ],
            "items": len(groups),
        }
    names = list(first["pooled"])
    avg = lambda xs: sum(xs) / len(xs)
    return {
        "mode": "replay_seeds",
        "seeds": seeds,
        "items": first["items"],
        "limit": first["limit"],
        "max_new_tokens": first["max_new_tokens"],
        "target": first["target"],
        "tokens": [d["tokens"] for d in docs],
        "pooled": {n: {"tau_pooled": avg([d["pooled"][n]["tau_pooled"] for d in docs])} for n in names},
        "mean": {n: avg([d["mean"][n] for d in docs]) for n in names},
        "results": {
            b: {n: {"tau_pooled": avg([d["results"][b][n]["tau_pooled"] for d in docs])} for n in names}
            for b in first["results"]
        },
        "pairs": pairs,
        "heldout": [d.get("heldout") for d in docs],
        "train": [(d.get("train_report") or {}).get("train") for d in docs],
        "runs": [{k: d.get(k) for k in ("git_sha", "command", "hardware")} for d in docs],
        "git_sha": first.get("git_sha"),
        "command": first.get("command"),
        "hardware": first.get("hardware"),
    }


def seeds_markdown(doc: dict) -> str:
    """A combine_seeds document as Markdown: τ per benchmark (the seeds' average), each pair's ratio over all
    seeds with its interval beside each seed's, and every seed's held-out per-slot accuracy."""
    n = len(doc["seeds"])
    lines = [
        f"T = 0, replayed on the target's greedy answers, {n} seeds ({', '.join(map(str, doc['seeds']))}): "
        f"{sum(doc['items'].values())} items per seed ({', '.join(f'{b} {k}' for b, k in doc['items'].items())}), "
        f"{doc['max_new_tokens']} new tokens at most; τ is the seeds' average\n",
        _tau_table(doc),
        "\n**Over the twin** (ratio pooled over every seed's items, 95% bootstrap over items; each seed's beside)\n",
    ]
    band = lambda ci: f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else ""
    rows = [
        [v, p["twin"], f"{p['ratio_pooled']:.3f}{band(p['ratio_ci'])}"]
        + [f"{s['ratio_pooled']:.3f}{band(s['ratio_ci'])}" for s in p["per_seed"]]
        + [p["items"]]
        for v, p in doc["pairs"].items()
    ]
    lines.append(md_table(["drafter", "twin", "ratio, all seeds", *(f"seed {s}" for s in doc["seeds"]), "items"], rows))
    for seed, held in zip(doc["seeds"], doc["heldout"]):
        if not held:
            continue
        lines += [
            f"\n**Held-out anchors, seed {seed}** (the same anchors for every drafter: τ_sim, per-slot accuracy)\n",
            _held_table(held),
        ]
    for seed, run, tr in zip(doc["seeds"], doc["runs"], doc["train"]):
        steps = f"{tr['steps']} steps, {tr['seconds']:.0f} s, " if tr else ""
        lines.append(f"\nseed {seed}: {steps}{run['git_sha']} · {run['hardware']} · `{run['command']}`")
    return "\n".join(lines) + "\n"


def replay_one(engines: dict, name: str, prompt_ids: list[int], forced: list[int]) -> dict:
    """One job of `replay` on `engines` (this process's, or a pool worker's)."""
    return _stats_of(engines[name].generate(prompt_ids, SamplingParams(temperature=0.0), forced=forced).stats)


REPLAY_FIELDS = ("tau", "rounds", "accepted", "accept_hist", "block_size")  # of AcceptanceStats.to_dict, per job


def _stats_of(st: AcceptanceStats) -> dict:
    d = st.to_dict()
    return {k: d[k] for k in REPLAY_FIELDS}


def _tau_table(doc: dict) -> str:
    """Pooled τ per benchmark and drafter, pooled over all items and the benchmarks' mean (a replay document)."""
    res = doc["results"]
    rows = [
        [n, *(f"{res[b][n]['tau_pooled']:.3f}" for b in res), f"{p['tau_pooled']:.3f}", f"{doc['mean'][n]:.3f}"]
        for n, p in doc["pooled"].items()
    ]
    return md_table(["drafter", *res, "pooled", "mean"], rows)


def _held_table(held: dict) -> str:
    """Each drafter on the held-out anchors: τ_sim and the accuracy of its first 8 slots."""
    shown = min(8, max(len(h["slot_acc"]) for h in held.values()))
    return md_table(
        ["drafter", "τ_sim", *(f"slot {i + 1}" for i in range(shown))],
        [[n, f"{h['tau_sim']:.3f}", *(f"{a:.3f}" for a in h["slot_acc"][:shown])] for n, h in held.items()],
    )


def replay_markdown(doc: dict) -> str:
    """A replay_benchmarks document as Markdown: τ per benchmark (pooled), pooled over all items and the
    benchmarks' mean; each pair's ratio with its interval; the held-out per-slot accuracy on identical anchors."""
    lines = [
        f"T = 0, every drafter replayed on the target's greedy answers: {sum(doc['items'].values())} items "
        f"({', '.join(f'{b} {n}' for b, n in doc['items'].items())}), {doc['tokens']} tokens, "
        f"{doc['max_new_tokens']} new tokens at most\n",
        _tau_table(doc),
    ]
    if doc.get("pairs"):
        rows = []
        for v, p in doc["pairs"].items():
            ci = p["ratio_ci"]
            band = f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else ""
            rows.append([v, p["twin"], f"{p['tau_pooled']:.3f}", f"{p['twin_tau_pooled']:.3f}"])
            rows[-1] += [f"{p['ratio_pooled']:.3f}{band}", f"{p['ratio_mean']:.3f}", p["items"]]
        lines += ["\n**Over the twin** (pooled ratio, 95% bootstrap over items; ratio of the benchmark means)\n"]
        lines.append(md_table(["drafter", "twin", "τ", "twin τ", "ratio pooled", "ratio of means", "items"], rows))
    held = doc.get("heldout")
    if held:
        lines += ["\n**Held-out anchors** (the same batches and anchors for every drafter: τ_sim, per-slot accuracy)\n"]
        lines.append(_held_table(held))
    lines.append(f"\n{doc.get('git_sha', '?')} · {doc.get('hardware', '?')} · `{doc.get('command', '')}`")
    return "\n".join(lines) + "\n"


def write_replay_results(doc: dict, out: str | Path) -> Path:
    """A replay document's JSON, its Markdown and an SVG of per-slot acceptance beside it (several seeds combined,
    `combine_seeds`: the JSON and its Markdown)."""
    out = Path(out)
    atomic_write_text(out, json_text(doc))
    seeds = doc.get("mode") == "replay_seeds"
    atomic_write_text(out.with_suffix(".md"), seeds_markdown(doc) if seeds else replay_markdown(doc))
    if seeds:
        return out
    pooled = doc["pooled"]
    panels = [
        ("P(slot k accepted), T = 0, replayed", {n: g["per_slot"][:SLOTS_SHOWN] for n, g in pooled.items()}),
        (
            "P(slot k | slot k-1 accepted), T = 0, replayed",
            {n: g["per_slot_conditional"][:SLOTS_SHOWN] for n, g in pooled.items()},
        ),
    ]
    atomic_write_text(out.with_suffix(".svg"), line_panels(panels, "block slot k"))
    return out
