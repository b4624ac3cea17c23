"""The agent-traffic race on the embedded engine: AR, suffix drafting (the request alone; + the corpus), DSpine and
the hybrid (DSpine + suffix + corpus in one verified tree), side by side in one run, on turns of real agent
conversations that the target regenerates, held out by task.

    python bench/agent_race.py --out bench/results/agent_race.json --summary bench/results/summary.json

Traffic: the shipped real agent conversations (agents.replay: `tool_replay` — tau-bench airline gpt-4o
conversations, tool calls and results included; `swe_replay` — SWE-Gym/OpenHands, SWE-smith, nebius and SWE-agent
conversations; workloads/data/agent_trajectories, see SOURCES.md), or --conversations. For each measured assistant
turn the exact preceding messages (tools included) are rendered as `dspine serve` renders them, cut from the left at
a message boundary to --max-context tokens (the system message kept), and the target generates the turn greedily.

Held out by task: the turns of every conversation are rendered once (`--save-rows`, with their tasks); when
measuring, the held-out tasks are the test part of a fine-tune (`--heldout finetune.json`: the adapted drafter never
trained on them, and they chose nothing) or else every other task, and only their turns are measured. The corpus
holds the other tasks only: their original assistant turns, or (`--corpus-traces DIR`) the target's own completions
of them from a replay collection, or (`--corpus-generate N`) the target's own completions of N of their turns per
workload generated before the race — what `dspine serve` accumulates from its traffic. Every method's output
is checked against AR's token for token. τ is tokens per target forward after the prefill (rounds without drafts
included); tok/s counts the whole request (prefill included); decode tok/s the tokens after the first over the
time after the prefill.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from itertools import zip_longest
from pathlib import Path

import torch

from dspine.checkpoint import load_drafter
from dspine.drafters import builtin_drafter
from dspine.engine import Engine
from dspine.eval.replay import greedy_completions
from dspine.goodput import SuffixChainPolicy, TreePolicy
from dspine.io import atomic_write_text, json_text, md_table, provenance, update_summary
from dspine.options import PREFIX_CACHE_TOKENS, EngineOptions
from dspine.prefix import PrefixCache
from dspine.sampling import SamplingParams
from dspine.state import TreeProfile
from dspine.suffix import SuffixConfig, SuffixCorpus
from dspine.target import load_target

METHODS = ("ar", "suffix", "suffix+corpus", "dspine", "hybrid")
ADAPTED = ("dspine-adapted", "hybrid-adapted")  # with --adapted: the fine-tuned drafter, alone and in the hybrid


PREFIX = "@prefix"  # a method's variant with a prefix cache (--prefix-variants)


def ar_of(m: str) -> str:
    """The AR a method is compared with: the one with a prefix cache for a @prefix variant."""
    return "ar" + PREFIX if m.endswith(PREFIX) else "ar"


def suffix_of(h: str) -> str:
    """suffix+corpus, the single method a hybrid is compared with beside its drafter (in its own cache setting)."""
    return "suffix+corpus" + (PREFIX if h.endswith(PREFIX) else "")


def hybrid_pairs(methods) -> dict:
    """Each hybrid method -> its DSpine drafter alone, what it is compared with beside suffix+corpus (hybrid and
    its variants hybrid@skipN -> dspine; hybrid-adapted... -> dspine-adapted; a @prefix variant -> the drafter's
    @prefix variant), where both are in the run."""
    pairs = {m: "dspine-adapted" if m.startswith("hybrid-adapted") else "dspine" for m in methods if "hybrid" in m}
    pairs = {h: d + (PREFIX if h.endswith(PREFIX) else "") for h, d in pairs.items()}
    return {h: d for h, d in pairs.items() if d in methods and suffix_of(h) in methods}


def ratio_key(h: str) -> str:
    return f"{h}_over_best_single".replace("-", "_")


def corpus_text(m: dict) -> str:
    """An original assistant turn as this target would write it: its text, then each tool call in the
    `<tool_call>` form the server parses back."""
    text = m.get("content") or ""
    for call in m.get("tool_calls") or []:
        fn = call["function"]
        text += "\n<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}) + "\n</tool_call>"
    return text


def render_rows(a) -> dict:
    """Every conversation's measured turns (up to --turns-per-task, spread over it; each prefix rendered as `dspine
    serve` renders it and cut from the left to --max-context tokens: agents.replay) and every original assistant
    turn as corpus text, all labelled with their task, so that which tasks are held out is decided when measuring."""
    from dspine.agents.replay import Renderer, plan_turns, prefix, read_all, shipped

    convs = read_all([a.conversations or str(shipped())])
    r = Renderer(a.target)
    rows, corpus = [], []
    for c in convs:
        for i, cut, _ in plan_turns(c, r, "none", a.max_context, a.turns_per_task).turns:
            ids = r.ids(prefix(c, i, cut), c.tools, "none")
            rows.append(
                {"workload": c.workload, "task": c.task_id, "conversation": c.id, "turn": i, "ids": ids, "cut": cut}
            )
        for m in c.messages:
            if m["role"] == "assistant" and corpus_text(m).strip():
                corpus.append({"workload": c.workload, "task": c.task_id, "ids": r.tokenizer.encode(corpus_text(m))})
    return {"target": a.target, "max_context": a.max_context, "rows": rows, "corpus": corpus}


def held_out(a, rows: list[dict]) -> set[str]:
    """The measured tasks ("workload:task"): with --heldout, the test part of that fine-tune (finetune.json: no
    adapted drafter trained on or was chosen on them); else every other task of each workload."""
    if a.heldout:
        doc = json.loads(Path(a.heldout).read_text())
        return {t for g in doc["groups"].values() for t in g["test_tasks"]}
    out = set()
    for w in sorted({r["workload"] for r in rows}):
        out |= {f"{w}:{t}" for t in sorted({r["task"] for r in rows if r["workload"] == w})[1::2]}
    return out


def select(a, saved: dict) -> tuple[list[dict], list[tuple[str, list[int]]], str]:
    """(the measured turns, the corpus as (workload, ids), what the corpus is): turns of held-out tasks only (at
    most --tasks tasks per workload), the corpus from the other tasks only — the original turns, or with
    --corpus-traces the target's own completions there (what `dspine serve` accumulates from its traffic)."""
    held = held_out(a, saved["rows"])
    rows = []
    for w in sorted({r["workload"] for r in saved["rows"]}):
        tasks = sorted({r["task"] for r in saved["rows"] if r["workload"] == w and f"{w}:{r['task']}" in held})
        keep = set(tasks[: a.tasks] if a.tasks else tasks)
        rows += [r for r in saved["rows"] if r["workload"] == w and r["task"] in keep]
    if a.corpus_generate:
        if a.corpus_traces:
            raise SystemExit("--corpus-generate and --corpus-traces each make the corpus: give one")
        pool = corpus_prompts(saved["rows"], held, a.corpus_generate)
        what = f"the target's own greedy completions of {len(pool)} turns of the other tasks, generated before the race"
    elif a.corpus_traces:
        from dspine.agents.traces import load_traces

        got = load_traces(a.corpus_traces).to_pylist()
        pool = [
            (r["workload"], r["completion_token_ids"]) for r in got if f"{r['workload']}:{r['task_id']}" not in held
        ]
        what = f"the target's own completions of the other tasks ({a.corpus_traces})"
    else:
        pool = [(c["workload"], c["ids"]) for c in saved["corpus"] if f"{c['workload']}:{c['task']}" not in held]
        what = "the original (gpt-4o and SWE agents') turns of the other tasks"
    if not rows:
        raise SystemExit("no turn of a held-out task to measure (is --heldout from these conversations?)")
    return rows, pool, what


def corpus_prompts(rows: list[dict], held: set[str], per_workload: int) -> list[tuple[str, list[int]]]:
    """At most `per_workload` turns per workload of the tasks not held out, taken from each task in turn (so every
    task contributes), as (workload, prompt ids): what `own_completions` answers."""
    out = []
    for w in sorted({r["workload"] for r in rows}):
        by_task: dict[str, list] = {}
        for r in rows:
            if r["workload"] == w and f"{w}:{r['task']}" not in held:
                by_task.setdefault(r["task"], []).append(r["ids"])
        turns = [ids for rnd in zip_longest(*(by_task[t] for t in sorted(by_task))) for ids in rnd if ids is not None]
        out += [(w, ids) for ids in turns[:per_workload]]
    return out


def own_completions(target, prompts: list[tuple[str, list[int]]], max_new: int, batch: int) -> list:
    """Each (workload, prompt ids) answered greedily by the target alone (`max_new` tokens, `batch` at a time) ->
    (workload, completion ids): the corpus `dspine serve` would hold after serving those turns."""
    t0 = time.time()
    answers = greedy_completions(target, [ids for _, ids in prompts], max_new, batch)
    print(f"corpus: {len(prompts)} turns answered in {time.time() - t0:.0f} s", file=sys.stderr)
    return [(w, ids) for (w, _), ids in zip(prompts, answers)]


def variant(eng: Engine, suffix: SuffixConfig | None) -> Engine:
    """A copy of an engine with `suffix` and its own tree node profile and tree policy (its rounds measured apart)."""
    eng = copy.copy(eng)
    eng.suffix, eng.tree_profile = suffix, TreeProfile(len(eng.tree_profile.offered))
    if suffix is not None:
        eng.tree_policy = TreePolicy(eng.round_tree, eng.tree_profile, suffix)
    return eng


def build_engines(a, target, cfg: SuffixConfig, corpus: SuffixCorpus) -> dict:
    """Each method's engine with the device's defaults (EngineOptions.build: on a CPU a small tree and the int8
    drafter `dspine serve` decodes with there, on a GPU the 32-node tree and the target's fp32)."""
    dtype = torch.qint8 if a.device == "cpu" else torch.float32
    drafter = load_drafter(a.drafter or builtin_drafter("smollm2-135m-instruct"), target, dtype, a.device)
    engines = {
        "ar": Engine(target),
        "suffix": Engine(target, None, suffix=cfg),
        "suffix+corpus": Engine(target, None, suffix=cfg, corpus=corpus),
        "dspine": EngineOptions().build(target, drafter),
        "hybrid": EngineOptions(suffix=True).build(target, drafter),
    }
    drafters = {"hybrid": drafter}
    if a.adapted:
        adapted = load_drafter(a.adapted, target, dtype, a.device)
        engines["dspine-adapted"] = EngineOptions().build(target, adapted)
        engines["hybrid-adapted"] = EngineOptions(suffix=True).build(target, adapted)
        drafters["hybrid-adapted"] = adapted
    for skip in a.skip_drafter_tokens:  # the hybrids again, skipping the drafter from another suffix confidence
        for h, d in drafters.items():
            engines[f"{h}@skip{skip:g}"] = eng = EngineOptions(suffix=True).build(target, d)
            eng.suffix = eng.tree_policy.cfg = dataclasses.replace(eng.suffix, skip_drafter_tokens=skip)
    if a.goodput_variants:  # every suffix method again, its nodes chosen by goodput
        for m in [m for m in engines if m != "ar" and not m.startswith("dspine")]:
            engines[f"{m}@goodput"] = variant(engines[m], dataclasses.replace(engines[m].suffix, tree_goodput=True))
    if a.padded_variant:  # suffix+corpus with its batched rounds padded where goodput says it pays
        eng = engines["suffix+corpus@padded"] = copy.copy(engines["suffix+corpus"])
        eng.suffix_policy = SuffixChainPolicy(pad=True)
    for m in [m for m in engines if "hybrid" in m]:
        engines[m].corpus = corpus  # the corpus above (EngineOptions starts an empty one)
    if a.methods:
        unknown = sorted(set(a.methods) - set(engines))
        if unknown or "ar" not in a.methods:
            raise SystemExit(f"--methods: {unknown or 'ar is needed'}; known: {', '.join(engines)}")
        engines = {m: engines[m] for m in a.methods}
    return engines


def warm_up(engines: dict, ids: list[int], a) -> dict:
    """An untimed first call per engine (the int8 drafter's kernels, allocations), then each method its own empty
    prefix cache of --prefix-cache-tokens (AR alike), or none; with --prefix-variants, every method again as
    METHOD@prefix with one (and the methods without) -> the engines."""
    tokens = a.prefix_cache_tokens or (PREFIX_CACHE_TOKENS if a.prefix_variants else 0)
    for eng in engines.values():
        eng.prefix_cache = None
        eng.generate(ids, SamplingParams(max_tokens=8))
    out = {}
    for m, eng in engines.items():
        if a.prefix_variants:
            out[m], eng = eng, variant(eng, eng.suffix)
            m += PREFIX
        eng.prefix_cache = PrefixCache(tokens) if tokens else None
        out[m] = eng
    return out


def _at_least(v: str, low: int) -> int:
    if not v.lstrip("-").isdigit() or int(v) < low:
        raise argparse.ArgumentTypeError(f"{v!r}: a whole number >= {low}")
    return int(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", help="a file or folder of conversations (default: the shipped ones)")
    ap.add_argument("--turns-per-task", type=int, default=2, help="assistant turns measured per conversation")
    ap.add_argument("--tasks", type=int, default=8, help="held-out tasks measured per workload at most (0: all)")
    ap.add_argument("--max-context", type=int, default=4096, help="prefix tokens at most (cut at a message boundary)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", help="JSON to write (a .md table beside it)")
    ap.add_argument("--summary", help="summary.json whose `agent_race` section is rewritten")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="the target (a built-in name, .gguf or folder)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: each engine takes that device's defaults")
    ap.add_argument("--drafter", help="the DSpine checkpoint (default: the shipped one)")
    ap.add_argument("--adapted", help="a fine-tuned checkpoint: adds dspine-adapted and hybrid-adapted")
    ap.add_argument(
        "--heldout",
        help="the fine-tune's finetune.json: measure its test tasks only (none of them trained on or chose anything)",
    )
    ap.add_argument(
        "--corpus-traces",
        help="a collection directory: the corpus is the target's own completions of the tasks not measured",
    )
    ap.add_argument(
        "--corpus-generate",
        type=lambda v: _at_least(v, 0),
        default=0,
        metavar="N",
        help="the corpus is the target's own greedy completions (--max-new-tokens each) of at most N turns per "
        "workload of the tasks not measured, generated here before the race — what `dspine serve` adds to its "
        "corpus from the traffic it serves (0: off)",
    )
    ap.add_argument(
        "--corpus-batch", type=lambda v: _at_least(v, 1), default=16, help="--corpus-generate: turns answered together"
    )
    ap.add_argument(
        "--save-rows", help="render every conversation's turns and corpus (token ids) into this file and stop"
    )
    ap.add_argument("--rows", help="measure the turns --save-rows wrote (no rendering: no pydantic needed)")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="above 1: every method decodes all turns with this many in flight (generate_stream, continuous "
        "batching as `dspine serve` schedules) and is reported by tokens/s over the whole run",
    )
    ap.add_argument(
        "--skip-drafter-tokens",
        type=lambda t: [float(x) for x in t.split(",") if x],
        default=[],
        help="comma-separated: each adds the hybrids again as hybrid@skipN, whose drafter is skipped when the suffix "
        "draft expects N accepted tokens (the default hybrid: SuffixConfig.skip_drafter_tokens)",
    )
    ap.add_argument(
        "--goodput-variants",
        action="store_true",
        help="adds every suffix method again as METHOD@goodput: its single request's rounds verify the suffix nodes "
        "and the drafter's subtree that goodput picks, the drafter skipped where it does not pay (SuffixConfig."
        "tree_goodput, goodput.TreePolicy; by default every node is verified, the drafter skipped by "
        "skip_drafter_tokens)",
    )
    ap.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="every method (AR included) keeps this many prompt tokens' prefill for reuse, as `dspine serve` does "
        "(dspine/prefix.py: a turn that begins with an earlier turn's prompt prefills only the rest); 0: none",
    )
    ap.add_argument(
        "--prefix-variants",
        action="store_true",
        help="every method runs twice, without a prefix cache and as METHOD@prefix with one (of "
        f"--prefix-cache-tokens, else {PREFIX_CACHE_TOKENS}); each × AR is against the AR of its own setting",
    )
    ap.add_argument(
        "--padded-variant",
        action="store_true",
        help="adds suffix+corpus@padded: at --concurrency > 1 its batched rounds pad rows with shorter matches to the "
        "length goodput picks (goodput.SuffixChainPolicy, SuffixConfig.pad_batches), beside the default that verifies "
        "the chain every open row fills",
    )
    ap.add_argument(
        "--methods",
        type=lambda t: [x for x in t.split(",") if x],
        default=[],
        help="comma-separated: only these methods (ar among them; default: all)",
    )
    a = ap.parse_args(argv)
    if a.save_rows:
        atomic_write_text(Path(a.save_rows), json.dumps(render_rows(a)))
        return 0
    if not a.out:
        ap.error("--out is needed to measure")
    rows, pool, corpus_from = select(a, json.loads(Path(a.rows).read_text()) if a.rows else render_rows(a))
    if a.device == "cpu":
        torch.set_num_threads(2)
    target = load_target(a.target, dtype=torch.float32, device=a.device)
    cfg = SuffixConfig()
    corpus = SuffixCorpus(cfg, target.info.vocab_size)
    if a.corpus_generate:
        pool = own_completions(target, pool, a.max_new_tokens, a.corpus_batch)
    for w, ids in pool:
        corpus.add(ids, w)
    engines = warm_up(build_engines(a, target, cfg, corpus), rows[0]["ids"][-64:], a)
    methods = tuple(engines)
    params = SamplingParams(max_tokens=a.max_new_tokens, temperature=0.0)
    results: dict[str, list[dict]] = {m: [] for m in methods}
    forwards = [0]  # target forwards: τ here is tokens per forward after the prefill, AR rounds included
    real_forward = target.forward
    target.forward = lambda *x, **k: forwards.__setitem__(0, forwards[0] + 1) or real_forward(*x, **k)
    if a.concurrency > 1:
        return _race_batched(a, engines, rows, params, methods)
    t_start, out = time.time(), Path(a.out)

    def write(done: int) -> dict:
        """The figures over the first `done` turns, written out (a run cut short still leaves what it measured)."""
        doc = {
            **provenance(),
            "settings": vars(a),
            "corpus": corpus_from,
            "corpus_tokens": {w: corpus.tokens(w) for w in corpus.indexes},
            "methods": list(methods),
            "suffix_config": cfg.__dict__,
            "workloads": cell_figures(rows[:done], {m: v[:done] for m, v in results.items()}, methods),
        }
        if done < len(rows):
            doc["partial"] = f"{done} of {len(rows)} turns measured"
        for h in hybrid_pairs(methods):
            doc[ratio_key(h)] = doc["workloads"]["all"][ratio_key(h)]
        atomic_write_text(out, json_text(doc))
        atomic_write_text(out.with_suffix(".md"), race_table(doc))
        return doc

    for k, r in enumerate(rows):
        for m in methods:
            before = forwards[0]
            res = engines[m].generate(r["ids"], params, profile=True, workload=r["workload"])
            pre = res.timings.get("prefill", 0.0)
            if a.device != "cpu":
                torch.cuda.synchronize()
            results[m].append(
                {
                    "tokens": res.token_ids,
                    "seconds": res.seconds,
                    "prefill_s": pre,
                    "cached": res.cached_tokens,
                    "rounds": forwards[0] - before - 1,  # the forwards after the prefill's
                }
            )
        print(
            f"[{k + 1}/{len(rows)}] {r['workload']} {r['task']} turn {r['turn']}: {len(r['ids'])} prompt tokens, "
            f"{time.time() - t_start:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        if k + 1 < len(rows) and (k + 1) % 8 == 0 and len({rows[i]["task"] for i in range(k + 1)}) > 1:
            write(k + 1)
    doc = write(len(rows))
    table = race_table(doc)
    if a.summary:
        keys = ("workloads", *map(ratio_key, hybrid_pairs(methods)), "git_sha", "command")
        update_summary(a.summary, "agent_race", {k: doc[k] for k in (*keys, "hardware") if k in doc})
    print(table)
    return 0


def _race_batched(a, engines: dict, rows: list[dict], params: SamplingParams, methods: tuple) -> int:
    """Every method over all turns at a.concurrency in flight: tokens/s over the run, × AR, = AR per turn."""
    from dspine.engine import generate_stream

    prompts, got = [r["ids"] for r in rows], {}
    for m in methods:
        t0 = time.time()
        res = generate_stream(engines[m], prompts, params, a.concurrency, workloads=[r["workload"] for r in rows])
        got[m] = (res, time.time() - t0)
        print(f"{m}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    doc = {**provenance(), "settings": vars(a), "concurrency": a.concurrency, "workloads": {}}
    for w in sorted({r["workload"] for r in rows}) + ["all"]:
        idx = [i for i, r in enumerate(rows) if w in ("all", r["workload"])]
        cell = {"rows": len(idx), "tasks": len({rows[i]["task"] for i in idx}), "match_ar": {}}
        for m, (res, _) in got.items():
            cell["match_ar"][m] = sum(res[i].token_ids == got["ar"][0][i].token_ids for i in idx) / len(idx)
        doc["workloads"][w] = cell
    toks = {m: sum(len(r.token_ids) for r in res) for m, (res, _) in got.items()}
    doc["tokens_per_s"] = {m: round(toks[m] / secs, 2) for m, (_, secs) in got.items()}
    doc["speed_vs_ar"] = {m: round(doc["tokens_per_s"][m] / doc["tokens_per_s"][ar_of(m)], 3) for m in methods}
    pairs = hybrid_pairs(methods)
    for h, d in pairs.items():
        doc[ratio_key(h)] = round(doc["tokens_per_s"][h] / max(doc["tokens_per_s"][m] for m in (suffix_of(h), d)), 3)
    rows_md = [
        [
            m,
            f"{doc['tokens_per_s'][m]:.1f}",
            f"{doc['speed_vs_ar'][m]:.2f}",
            f"{doc['workloads']['all']['match_ar'][m]:.2f}",
        ]
        for m in methods
    ]
    table = (
        f"concurrency {a.concurrency}, {len(rows)} turns (all workloads), tokens/s over the whole run "
        "(prefills included)\n\n"
        + md_table(["method", "tok/s", "× AR", "= AR"], rows_md)
        + "\n\n"
        + "".join(f"{h} / the faster of suffix+corpus and {d}: {doc[ratio_key(h)]:.2f}\n" for h, d in pairs.items())
        + "\n"
        + f"{doc['git_sha'][:7]} · {doc['hardware']} · `{doc['command']}`\n"
    )
    out = Path(a.out)
    atomic_write_text(out, json_text(doc))
    atomic_write_text(out.with_suffix(".md"), table)
    print(table)
    return 0


def cell_figures(rows: list[dict], results: dict, methods: tuple) -> dict:
    """{workload (and "all"): rows, tasks, τ, tok/s, × AR, = AR per method, hybrid over the best single, 95% CIs}."""
    out, cached_src = {}, "ar" + PREFIX if "ar" + PREFIX in methods else "ar"
    for w in sorted({r["workload"] for r in rows}) + ["all"]:
        idx = [i for i, r in enumerate(rows) if w in ("all", r["workload"])]
        cell = {
            "rows": len(idx),
            "tasks": len({rows[i]["task"] for i in idx}),
            "prompt_tokens_mean": round(sum(len(rows[i]["ids"]) for i in idx) / len(idx), 1),
            "cached_tokens_mean": round(sum(results[cached_src][i].get("cached", 0) for i in idx) / len(idx), 1),
            "tau": {},
            "tokens_per_s": {},
            "decode_tokens_per_s": {},
            "speed_vs_ar": {},
            "decode_vs_ar": {},
            "match_ar": {},
        }
        for m in methods:
            got = [results[m][i] for i in idx]
            toks = sum(len(g["tokens"]) for g in got)
            secs = sum(g["seconds"] for g in got)
            dec = sum(g["seconds"] - g["prefill_s"] for g in got)
            cell.setdefault("tokens", toks)  # AR's, the first; every method generates the same when it equals AR
            cell["tau"][m] = round((toks - len(got)) / max(1, sum(g["rounds"] for g in got)), 3)
            cell["tokens_per_s"][m] = round(toks / secs, 2)
            cell["decode_tokens_per_s"][m] = round((toks - len(got)) / dec, 2)
            cell["match_ar"][m] = sum(g["tokens"] == results["ar"][i]["tokens"] for g, i in zip(got, idx)) / len(idx)
        for m in methods:
            cell["speed_vs_ar"][m] = round(cell["tokens_per_s"][m] / cell["tokens_per_s"][ar_of(m)], 3)
            cell["decode_vs_ar"][m] = round(cell["decode_tokens_per_s"][m] / cell["decode_tokens_per_s"][ar_of(m)], 3)
        for h, d in hybrid_pairs(methods).items():
            best = max(cell["tokens_per_s"][m] for m in (suffix_of(h), d))
            cell[ratio_key(h)] = round(cell["tokens_per_s"][h] / best, 3)
        cell["ci95"] = task_intervals(rows, idx, results, methods)
        out[w] = cell
    return out


def task_intervals(rows: list[dict], idx: list[int], results: dict, methods: tuple, draws: int = 2000) -> dict:
    """95% bootstrap intervals over tasks (a task's turns resampled together) of each method's pooled τ and ×AR
    (tokens/s over the resampled turns), and of hybrid over the faster of suffix+corpus and DSpine."""
    import random

    tasks: dict[str, list[int]] = {}
    for i in idx:
        tasks.setdefault(rows[i]["task"], []).append(i)
    groups, rng = list(tasks.values()), random.Random(0)

    def figures(pick: list[int]) -> dict:
        tok = {m: sum(len(results[m][i]["tokens"]) for i in pick) for m in methods}
        tps = {m: tok[m] / sum(results[m][i]["seconds"] for i in pick) for m in methods}
        out = {f"tau/{m}": (tok[m] - len(pick)) / max(1, sum(results[m][i]["rounds"] for i in pick)) for m in methods}
        out.update({f"x_ar/{m}": tps[m] / tps[ar_of(m)] for m in methods})
        for h, d in hybrid_pairs(methods).items():
            out[ratio_key(h)] = tps[h] / max(tps[suffix_of(h)], tps[d])
        return out

    samples = [figures([i for g in rng.choices(groups, k=len(groups)) for i in g]) for _ in range(draws)]
    ci = {}
    for key in samples[0]:
        vals = sorted(x[key] for x in samples)
        ci[key] = [round(vals[int(0.025 * draws)], 3), round(vals[int(0.975 * draws) - 1], 3)]
    return ci


def race_table(doc: dict) -> str:
    lines = [f"**Partial: {doc['partial']}** (the run was cut short)\n"] if doc.get("partial") else []
    for w, c in doc["workloads"].items():
        lines.append(
            f"**{w}** — {c['rows']} turns, {c['tasks']} tasks, {c['tokens']} tokens per method, prompts "
            f"{c['prompt_tokens_mean']:.0f} tokens on average"
            + (
                f" ({c['cached_tokens_mean']:.0f} of them reused from the prefix cache)"
                if c.get("cached_tokens_mean")
                else ""
            )
            + "\n"
        )
        rows = [
            [
                m,
                f"{c['tau'][m]:.2f}",
                f"{c['tokens_per_s'][m]:.1f}",
                f"{c['speed_vs_ar'][m]:.2f}",
                f"{c['decode_tokens_per_s'][m]:.1f}",
                f"{c['decode_vs_ar'][m]:.2f}",
                f"{c['match_ar'][m]:.2f}",
            ]
            for m in doc.get("methods", METHODS)
        ]
        lines.append(md_table(["method", "τ", "tok/s", "× AR", "decode tok/s", "decode × AR", "= AR"], rows))
        ci = c.get("ci95", {})
        lines.append("")
        for h, d in hybrid_pairs(doc.get("methods", METHODS)).items():
            lines.append(
                f"{h} / the faster of {suffix_of(h)} and {d}: {c[ratio_key(h)]:.2f} (95% over tasks "
                f"{ci.get(ratio_key(h))}); {h} τ {ci.get('tau/' + h)}, × AR {ci.get('x_ar/' + h)}; {d} τ "
                f"{ci.get('tau/' + d)}, {suffix_of(h)} τ {ci.get('tau/' + suffix_of(h))}\n"
            )
    if doc.get("corpus"):
        lines.append(f"Corpus: {doc['corpus']}, {doc['corpus_tokens']} tokens per workload.\n")
    lines.append(f"{doc['git_sha'][:7]} · {doc['hardware']} · `{doc['command']}`")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
