"""What a batched speculative round costs on this machine, against the AR step of the same batch: for N open
requests drafting k tokens each, the target's verify forward of N·(k+1) rows and the drafter's forward of its
N·(k+1) block slots (the built-in target in fp32, the shipped drafter in --draft-dtype), on a KV cache of
--context positions per request. `break-even τ` = (verify + draft) / AR step: the tokens a round must commit per
request just to match AR — the acceptance the drafter needs at that batch size before drafting pays (propose,
commit and the Python between them come on top). Configurations are timed interleaved, medians reported.

    python bench/batch_rows.py --out bench/results/batch_rows.json
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dspine.checkpoint import load_models, resolve_drafter
from dspine.drafter import block_attention_mask
from dspine.engine import DraftContext
from dspine.io import atomic_write_text, comma_ints, md_table, provenance
from dspine.target import DEFAULT_TARGET


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=comma_ints, default=[1, 2, 4, 8], help="open requests N")
    ap.add_argument("--drafts", type=comma_ints, default=[0, 1, 2, 3, 5], help="drafts per request k (0: the AR step)")
    ap.add_argument("--context", type=int, default=200, help="cached positions per request")
    ap.add_argument("--draft-dtype", default="int8", help="the drafter's decode dtype (checkpoint.draft_dtype)")
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds per cell (median reported)")
    ap.add_argument("--out", default="batch_rows.json", help="JSON (a .md table beside it)")
    a = ap.parse_args()
    target, drafters = load_models(
        DEFAULT_TARGET, "float32", "cpu", {"d": resolve_drafter("builtin", DEFAULT_TARGET)}, a.draft_dtype
    )
    drafter = drafters["d"].bind(target)
    layers, V = drafter.config.target_layer_ids, target.info.vocab_size
    g = torch.Generator().manual_seed(0)
    state = {}
    with torch.no_grad():
        for N in a.batches:
            cache = target.new_cache()
            ids = torch.randint(0, V, (N, a.context), generator=g)
            _, feats = target.forward(ids, cache, layers)
            ctx = DraftContext(drafter)
            ctx.extend(feats, torch.arange(a.context).expand(N, -1))
            state[N] = (cache, ctx)
        times: dict[tuple, dict[str, list[float]]] = {
            (N, k): {"verify": [], "draft": []} for N in a.batches for k in a.drafts
        }
        for _ in range(a.repeats):
            for (N, k), t in times.items():
                cache, ctx = state[N]
                valid = torch.ones(N, a.context + k + 1, dtype=torch.long)
                pos = a.context + torch.arange(k + 1).expand(N, -1)
                t0 = time.perf_counter()
                target.forward(torch.randint(0, V, (N, k + 1), generator=g), cache, layers, valid, pos)
                t["verify"].append(time.perf_counter() - t0)
                target.crop_cache(cache, a.context)
                if k:
                    mask = block_attention_mask(valid[:, None, : a.context].bool(), k + 1, drafter.config.is_causal)
                    block = drafter.block_inputs(torch.randint(0, V, (N, 1), generator=g), k + 1)
                    t0 = time.perf_counter()
                    drafter(block, pos[:, None], ctx.kv, mask)
                    t["draft"].append(time.perf_counter() - t0)
    cells = []
    for (N, k), t in times.items():
        ms = {p: 1000 * statistics.median(v) if v else 0.0 for p, v in t.items()}
        ar = 1000 * statistics.median(times[(N, 0)]["verify"]) if (N, 0) in times else None
        cells.append(
            {
                "batch": N,
                "drafts": k,
                "rows": N * (k + 1),
                "verify_ms": ms["verify"],
                "draft_ms": ms["draft"],
                "break_even_tau": (ms["verify"] + ms["draft"]) / ar if ar else None,
            }
        )
    doc = {"cells": cells, "context": a.context, "draft_dtype": a.draft_dtype, "repeats": a.repeats, **provenance()}
    head = ["N", "k", "target rows", "verify ms", "draft ms", "break-even τ"]
    even = lambda c: f"{c['break_even_tau']:.2f}" if c["drafts"] and c["break_even_tau"] else "—"
    rows = [
        [c["batch"], c["drafts"], c["rows"], f"{c['verify_ms']:.1f}", f"{c['draft_ms']:.1f}", even(c)] for c in cells
    ]
    table = md_table(head, rows) + f"\ncontext {a.context}, drafter {a.draft_dtype}, {doc['hardware']}, "
    table += f"{doc['git_sha']}\n"
    print(table)
    out = Path(a.out)
    atomic_write_text(out, json.dumps(doc, indent=1) + "\n")
    atomic_write_text(out.with_suffix(".md"), table)


if __name__ == "__main__":
    main()
