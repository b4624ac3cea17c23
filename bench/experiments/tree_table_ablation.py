"""Ablation: how much of a draft tree's gain is the transition table's. The shipped DSpine drafter decoded through
one tree twice — nodes ranked by the transition table after their parent's token (as shipped), and ranked by each
slot's own logits (what a drafter without the table, e.g. DFlash, does; here the same weights with the table
switched off) — at T = 0 on the 7 benchmarks (fp32 engine, 10 items, 96 tokens; one process).

    python bench/experiments/tree_table_ablation.py [--tree SPEC] [--out bench/results/tree_table_ablation.json]
"""

import argparse
import sys

from dspine.checkpoint import load_models, resolve_drafter
from dspine.engine import GPU_DRAFT_TREE  # tree_profile_t0.md's 32-node pick
from dspine.eval.acceptance import evaluate, markdown_table, write_results
from dspine.workloads import BENCHMARKS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=GPU_DRAFT_TREE)
    ap.add_argument("--out", default="bench/results/tree_table_ablation.json")
    a = ap.parse_args()
    path = resolve_drafter("builtin", "smollm2-135m-instruct")
    target, ds = load_models("smollm2-135m-instruct", "float32", "cpu", {"table": path, "own": path})
    cfg = ds["own"].config

    class NoTable(type(cfg)):  # the same config, its transition table switched off (decoding reads this property)
        transition_cache = property(lambda self: False)

    cfg.__class__ = NoTable
    doc = evaluate(target, ds, list(BENCHMARKS), 10, [0.0], 96, progress=False, trees={"table": a.tree, "own": a.tree})
    write_results(doc, a.out)
    print(markdown_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
