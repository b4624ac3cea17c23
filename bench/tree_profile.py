"""Choose a draft tree from measurement: decode prompts through a wide candidate tree, count how often each
node is accepted per round (`engine.TreeProfile`), and prune it to the best tree of each node budget
(`DraftTree.prune`: predicted τ = 1 + the kept nodes' rates). Prints a table, writes JSON (git sha, command,
hardware). The prompts come from training pools, never the evaluation benchmarks; check a chosen tree there with
`dspine eval --draft-tree NAME=TREE`.

    python bench/tree_profile.py --temperature 1 --nodes 4,8,16,24,32 --out bench/results/tree_profile_t1.json
"""

import argparse
import shlex
import sys
import time

import torch
from tqdm.auto import tqdm

from dspine.checkpoint import load_models, resolve_drafter
from dspine.decoding import DraftTree
from dspine.engine import Engine
from dspine.io import atomic_write_text, json_text, md_table, provenance
from dspine.sampling import SamplingParams
from dspine.workloads import load_prompts


def candidate_tree(depth: int, rank_sums: dict[int, int], top_k: int) -> DraftTree:
    """Every rank path up to `depth` whose ranks sum to at most rank_sums[its length] (the largest key at or
    below it; 0 past the keys: the rank-0 chain), ranks below top_k."""

    def budget(n: int) -> int:
        return next((rank_sums[k] for k in sorted(rank_sums, reverse=True) if k <= n), 0) if n else 0

    paths, frontier = [], [()]
    for n in range(1, depth + 1):
        frontier = [p + (r,) for p in frontier for r in range(top_k) if sum(p) + r <= budget(n)]
        paths += frontier
    return DraftTree(tuple(sorted(paths, key=lambda p: (len(p), p))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="builtin", help="checkpoint folder, or builtin (default)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--pools", default="sharegpt_3k+gsm8k_train+mbpp_train", help="prompt pools, '+'-joined")
    ap.add_argument("--limit", type=int, default=12, help="prompts per pool (default: %(default)s)")
    ap.add_argument("--max-chars", type=int, default=2000, help="longest prompt kept (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument(
        "--rank-sums",
        default="1:3,3:2,5:1,9:0",
        help="the candidate tree: LENGTH:SUM pairs — paths of at least LENGTH nodes have ranks summing to at most "
        "SUM (past the last pair's reach only the rank-0 chain continues) (default: %(default)s)",
    )
    ap.add_argument("--depth", type=int, default=None, help="candidate tree depth (default: block size - 1)")
    ap.add_argument("--nodes", default="4,8,16,24,32", help="node budgets of the pruned trees")
    ap.add_argument("--out", required=True, help="JSON file (a .md table beside it)")
    a = ap.parse_args()
    if a.temperature < 0 or a.limit < 1 or a.max_new_tokens < 1:
        ap.error("--temperature >= 0, --limit and --max-new-tokens >= 1")
    try:
        sums = {int(k): int(v) for k, v in (x.split(":") for x in a.rank_sums.split(","))}
        budgets = [int(x) for x in a.nodes.split(",")]
    except ValueError:
        ap.error("--rank-sums LENGTH:SUM,... and --nodes N,... take integers")
    target, drafters = load_models(
        a.target, a.dtype, a.device, {"d": resolve_drafter(a.drafter, a.target) or a.drafter}
    )
    cfg = drafters["d"].config
    tree = candidate_tree(a.depth or cfg.block_size - 1, sums, cfg.top_k)
    eng = Engine(target, drafters["d"], tree=tree)
    prompts = load_prompts(a.pools, a.limit, a.max_chars)
    t0, tokens = time.perf_counter(), 0
    for i, p in enumerate(tqdm(prompts, desc=f"profile {len(tree.paths)} nodes")):
        res = eng.generate(p, SamplingParams(max_tokens=a.max_new_tokens, temperature=a.temperature, seed=i))
        tokens += len(res.token_ids)
    prof = eng.tree_profile
    rates = prof.rates
    rows, doc_trees = [], []
    for n in budgets + [len(tree.paths)]:
        sub = tree.prune(rates, n)
        kept = set(sub.paths)
        pred = 1 + sum(r for p, r in zip(tree.paths, rates) if p in kept)
        chain = 1 + sum(r for p, r in zip(tree.paths, rates) if p in kept and not any(p))
        doc_trees.append({"nodes": len(sub.paths), "tree": str(sub), "tau_pred": pred, "chain_part": chain})
        rows.append([len(sub.paths), sub.depth, f"{pred:.3f}", f"{chain:.3f}", str(sub)])
    by_node = sorted(zip(tree.paths, rates), key=lambda x: -x[1])
    doc = {
        **provenance(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "target": target.name,
        "drafter": a.drafter,
        "dtype": a.dtype,
        "temperature": a.temperature,
        "pools": a.pools,
        "prompts": len(prompts),
        "max_chars": a.max_chars,
        "max_new_tokens": a.max_new_tokens,
        "tokens": tokens,
        "seconds": time.perf_counter() - t0,
        "candidate_tree": str(tree),
        "candidate_nodes": len(tree.paths),
        "rounds": prof.rounds,
        "tau_measured": 1 + sum(prof.accepted) / max(prof.rounds, 1),
        "node_rates": {"".join(map(str, p)): r for p, r in by_node},
        "pruned": doc_trees,
    }
    md = (
        f"Draft-tree profile: {a.target} + {a.drafter}, T = {a.temperature:g}, {len(prompts)} prompts of {a.pools} "
        f"× {a.max_new_tokens} tokens, candidate tree of {len(tree.paths)} nodes ({prof.rounds} rounds, measured "
        f"τ {doc['tau_measured']:.3f})\n\n"
        + md_table(["nodes", "depth", "τ predicted", "of it the rank-0 chain", "tree"], rows)
        + "\n\nBest nodes (rank path: accepted per round): "
        + ", ".join(f"{''.join(map(str, p))}: {r:.3f}" for p, r in by_node[:24])
        + "\n"
    )
    atomic_write_text(a.out, json_text(doc))
    atomic_write_text(a.out.rsplit(".", 1)[0] + ".md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
