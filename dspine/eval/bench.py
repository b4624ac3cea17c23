"""`dspine bench --backend engine`: speed of AR and each drafter through the embedded engine, with the
time of a speculative round split into its phases (draft forward incl. injection, propose = transition
cache + walk, target verify, commit) from device-synchronised timing. AR always runs in the same call.

At concurrency c > 1 the engine keeps c requests in flight (engine.generate_stream: continuous batching, a
finished request replaced by the next at once, as `dspine serve` schedules) and reports throughput and τ;
`--backend sglang` (dspine/sglang/bench.py) gives the same tables from SGLang servers.

Target dtypes side by side (`--dtype float32,bfloat16`): the first is the reference; the others add rows
"NAME@DTYPE" (their own AR included). Every row reports its speed against the reference AR and against the AR of
its own dtype, and its AR match rates: the share of requests whose tokens equal the reference AR's (`match_ar`)
and its own dtype's AR's (`match_own_ar`). Only fp32 speculative decoding is lossless token for token; in bf16 a
verify forward over k tokens rounds differently from k one-token AR steps (the GEMMs are not batch-invariant),
so a bf16 row's match with its own AR is a measured rate, not a guarantee.
"""

from __future__ import annotations

import time

from dspine.engine import Engine, generate_stream
from dspine.io import md_table, provenance
from dspine.sampling import SamplingParams
from dspine.stats import summarize
from dspine.workloads import load_benchmark

PHASES = ("draft", "propose", "verify", "commit")


def _row(results: list, secs: float) -> dict:
    """Throughput, and τ for a drafter, over GenerationResults decoded in `secs`."""
    tokens = sum(r.completion_tokens for r in results)
    row = {"requests": len(results), "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs}
    if results and results[0].stats is not None:
        s = summarize([r.stats for r in results])
        row.update(tau_mean=s["tau_mean"], tau_pooled=s["tau_pooled"], rounds=s["rounds"])
    return row


def engine_bench(
    target,
    drafters: dict,
    benchmarks: list[str],
    limit: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    progress: bool = True,
    concurrencies: list[int] | None = None,
    draft_lens: list[int | tuple] | None = None,
    other_targets: dict | None = None,
    suffix: set | None = None,
) -> dict:
    """Concurrency 1: one request at a time, phases timed. Concurrency c > 1: c requests in flight
    (engine.generate_stream), throughput and τ only. `draft_lens`: each drafter is measured at each of these
    drafts-per-round (rows "<name>/d<D>"; a triple (D, S, M) also runs only S block slots, "b<S>", and drafts
    only in rounds of at most M open rows, "m<M>"; S, M None: no limit; M "g": each batched round drafts as
    many as its goodput asks, "g" — Engine(goodput=True)), side by side; D may be a draft tree's spec (rows
    "<name>/t<spec>": greedy rounds of one request verify that tree, batched rounds its depth as a chain).
    Every request (or chunk of requests) runs on all engines in turn before the next,
    so a machine whose speed drifts (a shared VM) shifts every row alike; each row's tokens/s is over its own
    decoding time, after one short untimed request per engine. `other_targets` {DTYPE tag: (target, drafters)}:
    the same rows for the target in another dtype, named NAME@TAG (module docstring). `suffix`: the drafter names
    that draft with suffix drafting too (a None drafter: suffix drafting alone, one row whatever `draft_lens`)."""
    from tqdm.auto import tqdm

    from dspine.suffix import SuffixConfig

    items = [(b, it) for b in benchmarks for it in load_benchmark(b, limit)]
    engines: dict[str, Engine] = {}
    own_ar: dict[str, str] = {}  # row -> the AR row of its target
    sets = {"": (target, drafters), **{f"@{k}": v for k, v in (other_targets or {}).items()}}
    for suffix_tag, (tgt, drs) in sets.items():
        engines["ar" + suffix_tag], own_ar["ar" + suffix_tag] = Engine(tgt), "ar" + suffix_tag
        for n, d in drs.items():
            sfx = SuffixConfig() if n in (suffix or ()) else None
            if d is None:  # suffix drafting alone
                engines[n + suffix_tag], own_ar[n + suffix_tag] = Engine(tgt, None, suffix=sfx), "ar" + suffix_tag
                continue
            for D in draft_lens or [None]:
                D, S, M = D if isinstance(D, tuple) else (D, None, None)
                tree = D if isinstance(D, str) else None  # a draft tree's spec (decoding.DraftTree)
                head = f"t{tree}" if tree else f"d{D}"
                cap = f"m{M}" if isinstance(M, int) else (M or "")
                name = (n if D is None else f"{n}/{head}" + (f"b{S}" if S else "") + cap) + suffix_tag
                cap_m = M if isinstance(M, int) else None
                engines[name] = Engine(tgt, d, None if tree else D, S, cap_m, tree, M == "g", sfx)
                own_ar[name] = "ar" + suffix_tag
    # untimed first: a path's first call compiles (Triton's JIT, CUDA's handles) and would bill it to one row
    for eng in engines.values():
        eng.generate(items[0][1].turns[0], SamplingParams(max_tokens=16, temperature=temperature, seed=0))
    batched = [c for c in (concurrencies or [1]) if c > 1]
    bar = tqdm(total=len(items) * len(engines) * (1 + len(batched)), desc="bench", disable=not progress)
    rows, tau_bench = _bench_single(engines, own_ar, items, max_new_tokens, temperature, bar)
    by_conc = {"1": rows}
    for c in batched:
        by_conc[str(c)] = _bench_batched(engines, own_ar, items, c, max_new_tokens, temperature, bar)
    bar.close()
    for crows in by_conc.values():
        for name, row in crows.items():
            row["speedup_vs_ar"] = row["tokens_per_s"] / crows["ar"]["tokens_per_s"]
            row["speedup_vs_own_ar"] = row["tokens_per_s"] / crows[own_ar[name]]["tokens_per_s"]
    for name, row in rows.items():
        step = rows[own_ar[name]]["ar_step_ms"]
        if name != own_ar[name] and step:
            row["round_over_ar_step"] = row["round_ms"] / step
    return {
        "backend": "engine",
        "concurrency": 1,
        "rows": rows,
        "by_concurrency": by_conc if batched else None,
        "tau_per_benchmark_c1": tau_bench,
        "benchmarks": benchmarks,
        "limit": limit,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "target": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "other_dtypes": {k: str(t.dtype).replace("torch.", "") for k, (t, _) in (other_targets or {}).items()},
        **provenance(),
    }


def _matches(results: dict, own_ar: dict, row: dict, name: str) -> None:
    """The row's AR match rates: requests whose tokens equal the reference AR's ("ar") and its own dtype's AR's."""
    for key, ref in (("match_ar", "ar"), ("match_own_ar", own_ar[name])):
        pairs = list(zip(results[name], results[ref]))
        row[key] = sum(a.token_ids == b.token_ids for a, b in pairs) / max(1, len(pairs))


def _bench_single(
    engines: dict, own_ar: dict, items: list, max_new_tokens: int, temperature: float, bar
) -> tuple[dict, dict]:
    """Concurrency 1, phases timed, every request on all engines in turn -> (rows, τ per benchmark per row)."""
    results = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    totals: dict[str, dict[str, float]] = {name: {} for name in engines}
    per_bench: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    for i, (bench, it) in enumerate(items):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            res = eng.generate(
                it.turns[0], SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=i), profile=True
            )
            seconds[name] += time.perf_counter() - t0
            results[name].append(res)
            for k, v in res.timings.items():
                totals[name][k] = totals[name].get(k, 0.0) + v
            if res.stats is not None:
                per_bench[name].setdefault(bench, []).append(res.stats.tau)
            bar.update(1)
    rows, tau_bench = {}, {}
    for name in engines:
        row = _row(results[name], seconds[name])
        _matches(results, own_ar, row, name)
        if name == own_ar[name]:
            steps = max(1, row["tokens"] - len(items))  # the first token of each request comes from the prefill
            row["ar_step_ms"] = 1000 * totals[name].get("ar_step", 0.0) / steps
        else:
            row["phase_ms_per_round"] = {p: 1000 * totals[name].get(p, 0.0) / max(1, row["rounds"]) for p in PHASES}
            row["round_ms"] = sum(row["phase_ms_per_round"].values())
            tau_bench[name] = {b: sum(t) / len(t) for b, t in per_bench[name].items()}
        rows[name] = row
    return rows, tau_bench


def _bench_batched(
    engines: dict, own_ar: dict, items: list, c: int, max_new_tokens: int, temperature: float, bar
) -> dict:
    """c requests in flight, the items in chunks of 3c, every chunk on all engines in turn (so that a drifting
    machine shifts every row alike) -> rows (throughput and τ; and the decode alone: the tokens after each
    request's first, which its prefill gives, over the seconds outside prefills — what speculation can speed up).
    """
    results = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    timings: dict[str, dict] = {name: {} for name in engines}
    for g in range(0, len(items), 3 * c):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            results[name] += generate_stream(
                eng,
                [it.turns[0] for _, it in items[g : g + 3 * c]],
                SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=g),
                c,
                timings[name],
            )
            seconds[name] += time.perf_counter() - t0
            bar.update(len(items[g : g + 3 * c]))
    rows = {name: _row(results[name], seconds[name]) for name in engines}
    for name, row in rows.items():
        _matches(results, own_ar, row, name)
        row["prefill_s"], row["batched_rounds"] = timings[name].get("prefill_s", 0.0), timings[name].get("rounds", 0)
        decode_s = max(row["seconds"] - row["prefill_s"], 1e-9)
        row["decode_tokens_per_s"] = (row["tokens"] - row["requests"]) / decode_s
    for row in rows.values():
        row["decode_vs_ar"] = row["decode_tokens_per_s"] / rows["ar"]["decode_tokens_per_s"]
    return rows


def cpu_summary(doc: dict) -> dict:
    """The `cpu` section of bench/results/summary.json from an engine bench: per drafter row, speculative vs
    AR tokens/s at concurrency 1 (and batched when measured), the round in AR steps and τ."""
    rows, by_conc = doc["rows"], doc.get("by_concurrency") or {}
    out = {}
    for name, r in rows.items():
        if name == "ar":
            continue
        out[name] = {
            "spec_vs_ar_c1": r["speedup_vs_ar"],
            "spec_vs_own_ar_c1": r["speedup_vs_own_ar"],
            "round_over_ar_step": r.get("round_over_ar_step"),
            "tau": r.get("tau_mean"),
            "match_ar": r["match_ar"],
            "match_own_ar": r["match_own_ar"],
            **{f"spec_vs_ar_c{c}": cr[name]["speedup_vs_ar"] for c, cr in by_conc.items() if c != "1"},
        }
    keep = ("benchmarks", "limit", "max_new_tokens", "dtype", "git_sha", "command", "hardware")
    return {
        "rows": out,
        "ar_tokens_per_s_c1": rows["ar"]["tokens_per_s"],
        **{k: doc.get(k) for k in keep},
        "other_dtypes": doc.get("other_dtypes") or {},
    }


def _method_rows(doc: dict) -> str:
    rows = []
    for name, r in doc["rows"].items():
        split = ", ".join(f"{k} {v:.2f}" for k, v in r.get("phase_ms_per_round", {}).items()) or "—"
        rows.append(
            [
                name,
                f"{r['tokens_per_s']:.1f}",
                f"{r['speedup_vs_ar']:.2f}",
                f"{r.get('speedup_vs_own_ar', r['speedup_vs_ar']):.2f}",
                f"{r.get('tau_mean', 1.0):.3f}",
                f"{r.get('round_ms', r.get('ar_step_ms', 0)):.2f}",
                f"{r.get('round_over_ar_step', 1.0):.2f}",
                f"{r['match_ar']:.2f}" if "match_ar" in r else "—",
                split,
            ]
        )
    header = ["method", "tok/s", "× AR", "× own AR", "τ", "round ms", "round / AR step", "= AR", "round split, ms"]
    return md_table(header, rows)


def _concurrency_rows(doc: dict) -> str:
    names = list(doc["rows"])
    rows = [
        [c, *(f"{r[n]['tokens_per_s']:.0f} ({r[n]['speedup_vs_ar']:.2f})" for n in names)]
        for c, r in doc["by_concurrency"].items()
    ]
    parts = [md_table(["concurrency", *(f"{n} tok/s (× AR)" for n in names)], rows)]
    batched = [(c, r) for c, r in doc["by_concurrency"].items() if "decode_tokens_per_s" in r.get("ar", {})]
    if batched:  # the decode alone, prefills left out
        rows = [
            [
                c,
                f"{r['ar']['prefill_s'] / r['ar']['seconds']:.2f}",
                *(f"{r[n]['decode_tokens_per_s']:.0f} ({r[n]['decode_vs_ar']:.2f})" for n in names),
            ]
            for c, r in batched
        ]
        header = ["concurrency", "AR's time in prefill", *(f"{n} decode tok/s (× AR)" for n in names)]
        parts.append(md_table(header, rows))
    return "\n\n".join(parts)


def _timing_rows(timed: list) -> str:
    """SGLang: where each set's wall time went (CUDA events inside SGLang)."""
    rows = []
    for c, n, r in timed:
        ph = r["phase_ms_per_round"]
        rows.append(
            [
                c,
                n,
                r["timed_rounds"],
                f"{r['gpu_round_ms']:.2f}",
                f"{ph['draft']:.2f} / {ph['verify']:.2f} / {ph['glue']:.2f}",
                f"{r['prefill_ms_total']:.0f}",
                f"{r['outside_rounds_s']:.2f}",
                f"{r['seconds']:.2f}",
            ]
        )
    header = [
        "concurrency",
        "method",
        "rounds",
        "GPU round ms",
        "draft / verify / glue ms",
        "prefills ms",
        "outside rounds s",
        "wall s",
    ]
    return md_table(header, rows)


def _agreement_rows(doc: dict) -> str:
    agree = doc["engine_agreement"]
    rows = [
        [
            b,
            *(
                f"{a['per_benchmark'][b]['sglang']:.3f} / {a['per_benchmark'][b]['engine']:.3f} "
                f"({a['per_benchmark'][b]['ratio']:.3f})"
                for a in agree.values()
            ),
        ]
        for b in doc["benchmarks"]
    ]
    return md_table(["benchmark", *(f"τ {n} SGLang / engine" for n in agree)], rows)


def bench_table(doc: dict) -> str:
    head = f"backend {doc['backend']}, concurrency {doc['concurrency']}, {doc['hardware']}"
    if doc.get("temperature"):
        head += f", temperature {doc['temperature']:g}"
    parts = [head, _method_rows(doc)]
    if doc.get("by_concurrency"):
        parts.append(_concurrency_rows(doc))
    timed = [
        (c, n, r)
        for c, rows in (doc.get("by_concurrency") or {}).items()
        for n, r in rows.items()
        if "gpu_round_ms" in r
    ]
    if timed:
        parts.append(_timing_rows(timed))
    if doc.get("engine_agreement"):
        parts.append(_agreement_rows(doc))
    if doc.get("tau_per_benchmark_c1"):
        per = doc["tau_per_benchmark_c1"]
        parts.append(
            md_table(
                ["benchmark", *(f"τ {n}" for n in per)],
                [[b, *(f"{per[n][b]:.3f}" for n in per)] for b in doc["benchmarks"]],
            )
        )
    return "\n\n".join(parts) + "\n"
