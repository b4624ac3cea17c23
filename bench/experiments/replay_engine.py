"""Replay traffic in volume on a GPU box that lacks the serving stack: the conversations' turns are rendered here
(the server's own rendering and cuts, agents.replay), generated there by the engine in batches, and written as
trace shards in the collection layout that `adapt/collect.py --source replay` writes (source "replay", the
original turn as `reference`, the cut, the exact token ids, the per-call acceptance of the shipped drafter).

    python bench/experiments/replay_engine.py render --out .carry/replay/turns.json.gz --max-turns 5
    python bench/experiments/replay_engine.py generate --turns .carry/replay/turns.json.gz --out runs/replay \\
        --device cuda --batch 16

The one difference from the job: `messages` holds the cut prefix's message count and roles, not the text (the
ids are the prefix); everything training and evaluation read is the same.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path


def render(a) -> int:
    from dspine.agents.replay import Renderer, plan_turns, prefix, read_all, reference, shipped

    convs = read_all([a.conversations or str(shipped())])
    r = Renderer(a.target)
    out = []
    for c in convs:
        plan = plan_turns(c, r, a.level, a.max_context - a.max_tokens, a.max_turns)
        for i, cut, _ in plan.turns:
            sent = prefix(c, i, cut)
            out.append(
                {
                    "conversation": c.id,
                    "workload": c.workload,
                    "task_id": c.task_id,
                    "turn": i,
                    "cut": cut,
                    "roles": [m["role"] for m in sent],
                    "tools": c.tools,
                    "reference": reference(c.messages[i]),
                    "ids": r.ids(sent, c.tools, a.level),
                }
            )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(a.out, "wt") as f:
        json.dump({"target": a.target, "level": a.level, "max_tokens": a.max_tokens, "turns": out}, f)
    n = {w: sum(t["workload"] == w for t in out) for w in {t["workload"] for t in out}}
    print(f"{len(out)} turns of {len(convs)} conversations -> {a.out}: {n}")
    return 0


def generate(a) -> int:
    import torch

    from dspine.agents.base import TraceRow, episode_id
    from dspine.agents.traces import Store, shard
    from dspine.checkpoint import load_drafter
    from dspine.drafters import builtin_drafter
    from dspine.engine import Engine, generate_batch
    from dspine.sampling import SamplingParams

    with gzip.open(a.turns, "rt") as f:
        doc = json.load(f)
    target_name = doc["target"]
    from dspine.target import load_target

    target = load_target(a.target or target_name, dtype=torch.float32, device=a.device)
    path = a.drafter or builtin_drafter(target_name)
    eng = Engine(target, load_drafter(path, target, device=a.device))
    turns = doc["turns"][: a.limit or None]
    order = sorted(range(len(turns)), key=lambda k: -len(turns[k]["ids"]))
    params = SamplingParams(max_tokens=doc["max_tokens"], temperature=0.0)
    rows: dict[str, list] = {}
    t0, done = time.time(), 0
    for s in range(0, len(order), a.batch):
        chunk = order[s : s + a.batch]
        t1 = time.time()
        res = generate_batch(eng, [turns[k]["ids"] for k in chunk], params)
        dt = time.time() - t1
        for k, r in zip(chunk, res):
            t = turns[k]
            ep = episode_id(t["workload"], t["conversation"], doc["level"], 0)
            hist = list(r.stats.accept_hist) if r.stats is not None else []
            rows.setdefault(ep, []).append(
                TraceRow(
                    episode_id=ep,
                    task_id=t["task_id"],
                    workload=t["workload"],
                    thinking=doc["level"],
                    turn=t["turn"],
                    request_id=f"{ep}-{t['turn']}",
                    messages=json.dumps({"roles": t["roles"]}),
                    tools=json.dumps(t["tools"]),
                    prompt_token_ids=t["ids"],
                    completion_token_ids=list(r.token_ids),
                    has_token_ids=True,
                    completion_text=target.decode(list(r.token_ids)),
                    tool_calls="[]",
                    finish_reason=r.finish_reason,
                    prompt_tokens=len(t["ids"]),
                    completion_tokens=len(r.token_ids),
                    accept_hist=hist,
                    tau=r.stats.tau if r.stats is not None and r.stats.rounds else None,
                    sampling=json.dumps({"temperature": 0.0, "max_tokens": doc["max_tokens"]}),
                    target=target_name,
                    drafter=str(path),
                    chat_template_sha256=None,
                    latency_s=dt / len(chunk),
                    ts=t1,
                    termination="replayed",
                    source="replay",
                    reference=t["reference"],
                    cut=t["cut"],
                )
            )
        done += len(chunk)
        print(f"{done}/{len(turns)} turns, {time.time() - t0:.0f} s", flush=True)
        if a.time_budget_s and time.time() - t0 > a.time_budget_s:
            print(f"time budget spent: {done} of {len(turns)} turns kept", flush=True)
            break
    st = Store(a.out)
    for ep, rs in rows.items():
        st.write_rows(sorted(rs, key=lambda r: r.turn), *shard(rs[0].workload, ep))
    st.clean_tmp()
    secs = time.time() - t0
    flat = [r for rs in rows.values() for r in rs]
    per: dict[str, list] = {}
    for r in flat:
        per.setdefault(r.workload, []).append(r)
    tokens = sum(r.completion_tokens for r in flat)
    summary = {
        "workloads": {
            w: {
                "conversations": len({r.episode_id for r in rs}),
                "tasks": len({r.task_id for r in rs}),
                "turns": len(rs),
                "tokens": sum(r.completion_tokens for r in rs),
                "prompt_tokens_mean": sum(r.prompt_tokens for r in rs) / len(rs),
            }
            for w, rs in sorted(per.items())
        },
        "seconds": secs,
        "tokens_per_s": tokens / secs,
        "batch": a.batch,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
    }
    Path(a.out, "replay_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("render", help="plan and render every turn here (tokenizer only)")
    r.add_argument("--conversations", default="", help="a file or folder (default: the shipped conversations)")
    r.add_argument("--target", default="smollm2-135m-instruct")
    r.add_argument("--level", default="none")
    r.add_argument("--max-context", type=int, default=8192)
    r.add_argument("--max-tokens", type=int, default=96)
    r.add_argument("--max-turns", type=int, default=5, help="turns per conversation, spread over it (0: all)")
    r.add_argument("--out", required=True)
    g = sub.add_parser("generate", help="generate every rendered turn with the engine -> trace shards")
    g.add_argument("--turns", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--device", default="cuda")
    g.add_argument("--batch", type=int, default=16)
    g.add_argument("--limit", type=int, default=0, help="the first N turns only (a smoke run)")
    g.add_argument("--time-budget-s", type=float, default=0, help="stop after this long, keeping what is done")
    g.add_argument("--target", default="", help="where the target is (default: the rendered target's name)")
    g.add_argument("--drafter", default="", help="drafter folder (default: the target's shipped drafter)")
    a = p.parse_args(argv)
    return render(a) if a.verb == "render" else generate(a)


if __name__ == "__main__":
    sys.exit(main())
