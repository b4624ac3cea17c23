"""The agent-traffic race on the embedded engine: AR, suffix drafting (the request alone; + the corpus), DSpine and
the hybrid (DSpine + suffix + corpus in one verified tree), side by side in one run, on turns of real agent
conversations that the target regenerates, held out by task.

    python bench/agent_race.py --out bench/results/agent_race.json --summary bench/results/summary.json

Traffic: `tool_replay` — tau-bench airline gpt-4o conversations (one trial per task, tool calls and results
included); `swe_replay` — SWE-Gym/OpenHands and SWE-smith conversations (../shared/data/agent_trajectories, see
its SOURCES.md). For each measured assistant turn the exact preceding messages (tools included) go through the
server's own rendering (dspine.serve.protocol) and the target's chat template, cut from the left at a message
boundary to --max-context tokens (the system message kept), and the target generates the turn greedily.

Held out by task: the tasks are split in two; the corpus holds the original assistant turns of one half
(tokenized by the target, per workload), the turns measured come from the other half only. Every method's output
is checked against AR's token for token. τ is tokens per target forward after the prefill (rounds without drafts
included); tok/s counts the whole request (prefill included); decode tok/s the tokens after the first over the
time after the prefill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dspine.checkpoint import load_drafter
from dspine.drafters import builtin_drafter
from dspine.engine import Engine
from dspine.io import atomic_write_text, json_text, md_table, provenance, update_summary
from dspine.options import EngineOptions
from dspine.sampling import SamplingParams
from dspine.suffix import SuffixConfig, SuffixCorpus
from dspine.target import load_target

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "agent_trajectories"
METHODS = ("ar", "suffix", "suffix+corpus", "dspine", "hybrid")


def conversations(data: Path) -> list[dict]:
    """{workload, task, messages, tools} per conversation: tau airline (first trial of each task), SWE sources."""
    out = []
    tau = json.loads((data / "tau_bench_airline_gpt4o" / "gpt-4o-airline.tasks-00-29.json").read_text())
    seen = set()
    for t in tau:
        if t["task_id"] in seen:
            continue
        seen.add(t["task_id"])
        out.append({"workload": "tool_replay", "task": f"airline-{t['task_id']}", "messages": t["traj"], "tools": None})
    for name in ("swe-gym_openhands_sampled_trajectories.sample_raw.json", "swe-smith.sample_raw.json"):
        for i, c in enumerate(json.loads((data / "swe_adp_samples" / name).read_text())):
            task = str(c.get("instance_id") or c.get("id") or f"{name}-{i}")
            out.append({"workload": "swe_replay", "task": task, "messages": c["messages"], "tools": c.get("tools")})
    return out


def clean(m: dict) -> dict:
    """An OpenAI message as the server accepts it (string content; tool calls' ids and arguments as given)."""
    d = {"role": m["role"], "content": m.get("content") or ("" if m["role"] != "assistant" else None)}
    if m.get("tool_calls"):
        d["tool_calls"] = [
            {"id": c.get("id") or f"call_{k}", "type": "function", "function": c["function"]}
            for k, c in enumerate(m["tool_calls"])
        ]
    if m["role"] == "tool":
        d["tool_call_id"] = m.get("tool_call_id") or "call_0"
    return d


def render(target, messages: list[dict], tools, max_context: int) -> tuple[list[int], int]:
    """The prefix's token ids as `dspine serve` renders it, cut from the left at message boundaries (the system
    message kept) to at most max_context tokens -> (ids, messages cut)."""
    from dspine.serve.protocol import parse_request, template_has_tools, template_messages

    native = template_has_tools(getattr(target.tokenizer, "chat_template", None))
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system) :]
    for cut in range(len(rest)):
        body = {"messages": system + rest[cut:], **({"tools": tools} if tools else {})}
        if rest[cut]["role"] == "tool":
            continue  # a tool result must follow its call
        req = parse_request(body, True)
        msgs, kw = template_messages(req, native)
        ids = target.chat_ids(msgs, **kw)
        if len(ids) <= max_context:
            return ids, cut
    return [], len(rest)


def turns(target, convs: list[dict], per_conv: int, max_context: int) -> list[dict]:
    """The measured turns: up to per_conv assistant turns per conversation, spread over it."""
    rows = []
    for c in convs:
        msgs = [clean(m) for m in c["messages"]]
        at = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i >= 2]
        pick = [at[round(k * (len(at) - 1) / max(per_conv - 1, 1))] for k in range(min(per_conv, len(at)))]
        for i in sorted(set(pick)):
            ids, cut = render(target, msgs[:i], c["tools"], max_context)
            if ids:
                rows.append({"workload": c["workload"], "task": c["task"], "turn": i, "ids": ids, "cut": cut})
    return rows


def corpus_rows(target, convs: list[dict]) -> list[tuple[str, list[int]]]:
    """(workload, token ids) of every assistant turn's text and tool calls in these conversations."""
    out = []
    for c in convs:
        for m in c["messages"]:
            if m["role"] != "assistant":
                continue
            text = m.get("content") or ""
            for call in m.get("tool_calls") or []:
                text += (
                    "\n<tool_call>\n"
                    + json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
                    + "\n</tool_call>"
                )
            if text.strip():
                out.append((c["workload"], target.encode(text)))
    return out


def load_rows(a, target) -> tuple[list[dict], list[tuple[str, list[int]]]]:
    """(the measured turns, the corpus rows): read from --rows, or rendered from the conversations (held out by
    task: every other task is measured, the rest feed the corpus)."""
    if a.rows:
        saved = json.loads(Path(a.rows).read_text())
        rows, pool = saved["rows"], [tuple(x) for x in saved["corpus"]]
    else:
        convs = conversations(Path(a.data))
        held, base = [], []
        for w in sorted({c["workload"] for c in convs}):
            mine = [c for c in convs if c["workload"] == w]
            held += mine[1::2][: a.tasks]  # every other task is measured, the rest feed the corpus
            base += mine[0::2]
        rows, pool = turns(target, held, a.turns_per_task, a.max_context), corpus_rows(target, base)
    return rows, pool


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA), help="the agent_trajectories folder (default: %(default)s)")
    ap.add_argument("--turns-per-task", type=int, default=2, help="assistant turns measured per conversation")
    ap.add_argument("--tasks", type=int, default=8, help="measured (held-out) conversations per workload at most")
    ap.add_argument("--max-context", type=int, default=2048, help="prefix tokens at most (cut at a message boundary)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", help="JSON to write (a .md table beside it)")
    ap.add_argument("--summary", help="summary.json whose `agent_race` section is rewritten")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="the target (a built-in name, .gguf or folder)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: each engine takes that device's defaults")
    ap.add_argument("--drafter", help="the DSpine checkpoint (default: the shipped one)")
    ap.add_argument("--save-rows", help="render the turns and the corpus (token ids) into this file and stop")
    ap.add_argument("--rows", help="measure the turns and corpus --save-rows wrote (no rendering: no pydantic needed)")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="above 1: every method decodes all turns with this many in flight (generate_stream, continuous "
        "batching as `dspine serve` schedules) and is reported by tokens/s over the whole run",
    )
    a = ap.parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(2)
    target = load_target(a.target, dtype=torch.float32, device=a.device)
    cpu = a.device == "cpu"  # the drafter as `dspine serve` decodes it there: int8 on a CPU, else the target's fp32
    path = a.drafter or builtin_drafter("smollm2-135m-instruct")
    drafter = load_drafter(path, target, torch.qint8 if cpu else torch.float32, a.device)
    rows, pool = load_rows(a, target)
    if a.save_rows:
        atomic_write_text(Path(a.save_rows), json.dumps({"rows": rows, "corpus": pool}))
        return 0
    if not a.out:
        ap.error("--out is needed to measure")
    cfg = SuffixConfig()
    corpus = SuffixCorpus(cfg, target.info.vocab_size)
    for w, ids in pool:
        corpus.add(ids, w)
    engines = {  # the device's defaults (EngineOptions.build: on a CPU a small tree, on a GPU the 32-node one)
        "ar": Engine(target),
        "suffix": Engine(target, None, suffix=cfg),
        "suffix+corpus": Engine(target, None, suffix=cfg, corpus=corpus),
        "dspine": EngineOptions().build(target, drafter),
        "hybrid": EngineOptions(suffix=True).build(target, drafter),
    }
    engines["hybrid"].corpus = corpus  # the corpus above (EngineOptions starts an empty one)
    params = SamplingParams(max_tokens=a.max_new_tokens, temperature=0.0)
    results: dict[str, list[dict]] = {m: [] for m in METHODS}
    forwards = [0]  # target forwards: τ here is tokens per forward after the prefill, AR rounds included
    real_forward = target.forward
    target.forward = lambda *x, **k: forwards.__setitem__(0, forwards[0] + 1) or real_forward(*x, **k)
    for eng in engines.values():  # untimed first calls (the int8 drafter's kernels, allocations)
        eng.generate(rows[0]["ids"][-64:], SamplingParams(max_tokens=8))
    if a.concurrency > 1:
        return _race_batched(a, engines, rows, params)
    t_start = time.time()
    for k, r in enumerate(rows):
        for m in METHODS:
            before = forwards[0]
            res = engines[m].generate(r["ids"], params, profile=True)
            pre = res.timings.get("prefill", 0.0)
            if a.device != "cpu":
                torch.cuda.synchronize()
            results[m].append(
                {
                    "tokens": res.token_ids,
                    "seconds": res.seconds,
                    "prefill_s": pre,
                    "rounds": forwards[0] - before - 1,  # the forwards after the prefill's
                }
            )
        print(
            f"[{k + 1}/{len(rows)}] {r['workload']} {r['task']} turn {r['turn']}: {len(r['ids'])} prompt tokens, "
            f"{time.time() - t_start:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    doc = {
        **provenance(),
        "settings": vars(a),
        "corpus_tokens": {w: corpus.tokens(w) for w in corpus.indexes},
        "suffix_config": cfg.__dict__,
        "workloads": {},
    }
    for w in sorted({r["workload"] for r in rows}) + ["all"]:
        idx = [i for i, r in enumerate(rows) if w in ("all", r["workload"])]
        cell = {
            "rows": len(idx),
            "tasks": len({rows[i]["task"] for i in idx}),
            "prompt_tokens_mean": round(sum(len(rows[i]["ids"]) for i in idx) / len(idx), 1),
            "tau": {},
            "tokens_per_s": {},
            "decode_tokens_per_s": {},
            "speed_vs_ar": {},
            "decode_vs_ar": {},
            "match_ar": {},
        }
        for m in METHODS:
            got = [results[m][i] for i in idx]
            toks = sum(len(g["tokens"]) for g in got)
            secs = sum(g["seconds"] for g in got)
            dec = sum(g["seconds"] - g["prefill_s"] for g in got)
            cell.setdefault("tokens", toks)  # AR's, the first; every method generates the same when it equals AR
            cell["tau"][m] = round((toks - len(got)) / max(1, sum(g["rounds"] for g in got)), 3)
            cell["tokens_per_s"][m] = round(toks / secs, 2)
            cell["decode_tokens_per_s"][m] = round((toks - len(got)) / dec, 2)
            cell["match_ar"][m] = sum(g["tokens"] == results["ar"][i]["tokens"] for g, i in zip(got, idx)) / len(idx)
        for m in METHODS:
            cell["speed_vs_ar"][m] = round(cell["tokens_per_s"][m] / cell["tokens_per_s"]["ar"], 3)
            cell["decode_vs_ar"][m] = round(cell["decode_tokens_per_s"][m] / cell["decode_tokens_per_s"]["ar"], 3)
        best = max(cell["tokens_per_s"][m] for m in ("suffix+corpus", "dspine"))
        cell["hybrid_over_best_single"] = round(cell["tokens_per_s"]["hybrid"] / best, 3)
        cell["ci95"] = task_intervals(rows, idx, results)
        doc["workloads"][w] = cell
    doc["hybrid_over_best_single"] = doc["workloads"]["all"]["hybrid_over_best_single"]
    out = Path(a.out)
    atomic_write_text(out, json_text(doc))
    table = race_table(doc)
    atomic_write_text(out.with_suffix(".md"), table)
    if a.summary:
        keys = ("workloads", "hybrid_over_best_single", "git_sha", "command", "hardware")
        update_summary(a.summary, "agent_race", {k: doc[k] for k in keys})
    print(table)
    return 0


def _race_batched(a, engines: dict, rows: list[dict], params: SamplingParams) -> int:
    """Every method over all turns at a.concurrency in flight: tokens/s over the run, × AR, = AR per turn."""
    from dspine.engine import generate_stream

    prompts, got = [r["ids"] for r in rows], {}
    for m in METHODS:
        t0 = time.time()
        res = generate_stream(engines[m], prompts, params, a.concurrency)
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
    doc["speed_vs_ar"] = {m: round(doc["tokens_per_s"][m] / doc["tokens_per_s"]["ar"], 3) for m in METHODS}
    best = max(doc["tokens_per_s"][m] for m in ("suffix+corpus", "dspine"))
    doc["hybrid_over_best_single"] = round(doc["tokens_per_s"]["hybrid"] / best, 3)
    rows_md = [
        [
            m,
            f"{doc['tokens_per_s'][m]:.1f}",
            f"{doc['speed_vs_ar'][m]:.2f}",
            f"{doc['workloads']['all']['match_ar'][m]:.2f}",
        ]
        for m in METHODS
    ]
    table = (
        f"concurrency {a.concurrency}, {len(rows)} turns (all workloads), tokens/s over the whole run "
        "(prefills included)\n\n"
        + md_table(["method", "tok/s", "× AR", "= AR"], rows_md)
        + f"\n\nhybrid / the faster of suffix+corpus and DSpine: {doc['hybrid_over_best_single']:.2f}\n\n"
        + f"{doc['git_sha'][:7]} · {doc['hardware']} · `{doc['command']}`\n"
    )
    out = Path(a.out)
    atomic_write_text(out, json_text(doc))
    atomic_write_text(out.with_suffix(".md"), table)
    print(table)
    return 0


def task_intervals(rows: list[dict], idx: list[int], results: dict, draws: int = 2000) -> dict:
    """95% bootstrap intervals over tasks (a task's turns resampled together) of each method's pooled τ and ×AR
    (tokens/s over the resampled turns), and of hybrid over the faster of suffix+corpus and DSpine."""
    import random

    tasks: dict[str, list[int]] = {}
    for i in idx:
        tasks.setdefault(rows[i]["task"], []).append(i)
    groups, rng = list(tasks.values()), random.Random(0)

    def figures(pick: list[int]) -> dict:
        tok = {m: sum(len(results[m][i]["tokens"]) for i in pick) for m in METHODS}
        tps = {m: tok[m] / sum(results[m][i]["seconds"] for i in pick) for m in METHODS}
        out = {f"tau/{m}": (tok[m] - len(pick)) / max(1, sum(results[m][i]["rounds"] for i in pick)) for m in METHODS}
        out.update({f"x_ar/{m}": tps[m] / tps["ar"] for m in METHODS})
        out["hybrid_over_best_single"] = tps["hybrid"] / max(tps["suffix+corpus"], tps["dspine"])
        return out

    samples = [figures([i for g in rng.choices(groups, k=len(groups)) for i in g]) for _ in range(draws)]
    ci = {}
    for key in samples[0]:
        vals = sorted(x[key] for x in samples)
        ci[key] = [round(vals[int(0.025 * draws)], 3), round(vals[int(0.975 * draws) - 1], 3)]
    return ci


def race_table(doc: dict) -> str:
    lines = []
    for w, c in doc["workloads"].items():
        lines.append(
            f"**{w}** — {c['rows']} turns, {c['tasks']} tasks, {c['tokens']} tokens per method, prompts "
            f"{c['prompt_tokens_mean']:.0f} tokens on average\n"
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
            for m in METHODS
        ]
        lines.append(md_table(["method", "τ", "tok/s", "× AR", "decode tok/s", "decode × AR", "= AR"], rows))
        ci = c.get("ci95", {})
        lines.append(
            f"\nhybrid / the faster of suffix+corpus and DSpine: {c['hybrid_over_best_single']:.2f} "
            f"(95% over tasks {ci.get('hybrid_over_best_single')}); hybrid τ {ci.get('tau/hybrid')}, "
            f"× AR {ci.get('x_ar/hybrid')}; DSpine τ {ci.get('tau/dspine')}, suffix τ {ci.get('tau/suffix')}\n"
        )
    lines.append(f"{doc['git_sha'][:7]} · {doc['hardware']} · `{doc['command']}`")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
