"""Suffix drafting's τ against the size of the deployment's corpus, on the agent race's held-out turns.

    python bench/suffix_corpus_sweep.py --out bench/results/suffix_corpus_sweep.json

The turns and the corpus tasks are bench/agent_race.py's (held out by task). The target answers each turn once
(greedy, AR); at T = 0 a deterministic draft is accepted exactly while it matches that answer, so suffix drafting's
rounds are replayed on the recorded token ids without the target: each round drafts the tree (the request's own
index + the corpus), the longest root path matching the answer is accepted, plus the target's next token. Two
corpora grow in steps (a fraction of their rows, in a fixed shuffled order), as served traffic would grow them:
`served` — the target's own answers to the corpus tasks' turns (what `dspine serve` adds as requests finish), and
`original` — those tasks' original assistant turns (gpt-4o's text). τ: tokens per verify round, rounds without
drafts included, per workload at each size.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_race import DATA, conversations, corpus_rows, turns

from dspine.engine import Engine
from dspine.io import atomic_write_text, json_text, md_table, provenance, update_summary
from dspine.sampling import SamplingParams
from dspine.suffix import RequestSuffix, SuffixConfig, SuffixCorpus
from dspine.target import load_target


def replay_tau(prompt: list[int], answer: list[int], cfg: SuffixConfig, corpus: SuffixCorpus | None, workload: str):
    """-> (tokens, rounds) of suffix drafting on this greedy answer (the first token comes from the prefill)."""
    state = RequestSuffix(prompt, cfg, corpus, workload)
    state.push(answer[:1])
    at, rounds = 1, 0
    while at < len(answer):
        d = state.draft()
        node, n = -1, 0
        while True:  # follow the child that matches the answer
            nxt = (
                next(
                    (i for i, (t, p) in enumerate(zip(d.tokens, d.parents)) if p == node and t == answer[at + n]), None
                )
                if at + n < len(answer)
                else None
            )
            if nxt is None:
                break
            node, n = nxt, n + 1
        step = min(n + 1, len(answer) - at)  # accepted drafts + the target's own next token
        state.push(answer[at : at + step])
        at, rounds = at + step, rounds + 1
    return len(answer) - 1, rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--turns-per-task", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fractions", default="0,0.25,0.5,1", help="corpus sizes, as fractions of the corpus tasks")
    ap.add_argument("--out", required=True)
    ap.add_argument("--summary", help="summary.json whose `agent_race` section gains `tau_vs_corpus`")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    target = load_target("smollm2-135m-instruct", dtype=torch.float32)
    convs = conversations(Path(a.data))
    held, base = [], []
    for w in sorted({c["workload"] for c in convs}):
        mine = [c for c in convs if c["workload"] == w]
        held += mine[1::2][: a.tasks]
        base += mine[0::2]
    rows = turns(target, held, a.turns_per_task, a.max_context)
    served = turns(target, base, a.turns_per_task, a.max_context)
    ar = Engine(target)
    for r in rows + served:
        r["answer"] = ar.generate(r["ids"], SamplingParams(max_tokens=a.max_new_tokens)).token_ids
    pools = {"served": [(r["workload"], r["answer"]) for r in served], "original": corpus_rows(target, base)}
    cfg = SuffixConfig()
    doc = {**provenance(), "settings": vars(a), "by_size": []}
    for name, pool in pools.items():
        random.Random(0).shuffle(pool)
        for frac in [float(x) for x in a.fractions.split(",")]:
            corpus = SuffixCorpus(cfg, target.info.vocab_size)
            for w, ids in pool[: round(frac * len(pool))]:
                corpus.add(ids, w)
            tokens = {w: corpus.tokens(w) for w in sorted(corpus.indexes)}
            entry = {"corpus": name, "fraction": frac, "corpus_tokens": tokens, "tau": {}}
            for w in sorted({r["workload"] for r in rows}):
                got = [replay_tau(r["ids"], r["answer"], cfg, corpus, w) for r in rows if r["workload"] == w]
                entry["tau"][w] = round(sum(t for t, _ in got) / max(1, sum(n for _, n in got)), 3)
            doc["by_size"].append(entry)
    doc["rows"] = {w: sum(r["workload"] == w for r in rows) for w in sorted({r["workload"] for r in rows})}
    doc["tasks"] = {w: len({r["task"] for r in rows if r["workload"] == w}) for w in doc["rows"]}
    header = ["corpus", "fraction of its rows", "tokens", *(f"τ {w}" for w in doc["rows"])]
    body = [
        [
            e["corpus"],
            f"{e['fraction']:.2f}",
            sum(e["corpus_tokens"].values()),
            *(f"{e['tau'][w]:.3f}" for w in doc["rows"]),
        ]
        for e in doc["by_size"]
    ]
    table = md_table(header, body)
    table += (
        f"\n\nrows {doc['rows']}, tasks {doc['tasks']}; {doc['git_sha'][:7]} · {doc['hardware']} · `{doc['command']}`\n"
    )
    atomic_write_text(Path(a.out), json_text(doc))
    atomic_write_text(Path(a.out).with_suffix(".md"), table)
    if a.summary:
        import json

        summary = json.loads(Path(a.summary).read_text())
        section = summary.get("agent_race", {})
        section["tau_vs_corpus"] = {"by_size": doc["by_size"], "rows": doc["rows"], "tasks": doc["tasks"]}
        update_summary(a.summary, "agent_race", section)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
