"""The built-in target's forward on the CPU (fp32) for 1, 6 and 16 new rows on a KV cache of several lengths:
transformers' SDPA attention (which copies the whole cache once per KV-head group for a masked multi-row
forward) against dspine's (`target._sdpa_gqa`: the groups stay inside torch's SDPA). A verify of D drafts is a
forward of D + 1 rows; a decode step is one row. Both variants are timed interleaved in one process.

    python bench/cpu_attention.py --contexts 200,1000,2000 --out bench/results/cpu_attention.json
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dspine.io import atomic_write_text, comma_ints, md_table, provenance
from dspine.target import _SDPA_GQA, DEFAULT_TARGET, load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--contexts", type=comma_ints, default=[200, 1000, 2000], help="cached positions before the forward"
    )
    ap.add_argument("--rows", type=comma_ints, default=[1, 6, 16], help="new rows per forward")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per cell (median reported)")
    ap.add_argument("--out", default="cpu_attention.json", help="JSON (a .md table beside it)")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    tgt = load_target(DEFAULT_TARGET, dtype=torch.float32, device="cpu")
    variants = {"transformers": "sdpa", "dspine": _SDPA_GQA}
    if tgt.model.config._attn_implementation != _SDPA_GQA:
        raise SystemExit("the target does not attend through dspine's SDPA here (DSPINE_CPU_GQA=0?)")
    g = torch.Generator().manual_seed(0)
    cells = []
    for ctx in a.contexts:
        cache = tgt.new_cache()
        tgt.forward(torch.randint(100, 10000, (1, ctx), generator=g), cache)
        times = {}
        for _ in range(a.repeats):
            for name, impl in variants.items():
                tgt.model.set_attn_implementation(impl)
                for n in a.rows:
                    x = torch.randint(100, 10000, (1, n), generator=g)
                    t0 = time.perf_counter()
                    tgt.forward(x, cache)
                    times.setdefault((name, n), []).append((time.perf_counter() - t0) * 1e3)
                    tgt.crop_cache(cache, ctx)
        tgt.model.set_attn_implementation(_SDPA_GQA)
        ms = {(k, n): statistics.median(v) for (k, n), v in times.items()}
        step = min(a.rows)
        for n in a.rows:
            cells.append(
                {
                    "context": ctx,
                    "rows": n,
                    **{f"{k}_ms": ms[k, n] for k in variants},
                    **{f"{k}_over_step": ms[k, n] / ms[k, step] for k in variants},
                }
            )
    doc = {"target": DEFAULT_TARGET, "threads": torch.get_num_threads(), "cells": cells, **provenance()}
    out = Path(a.out)
    atomic_write_text(out, json.dumps(doc, indent=1))
    rows = [
        [
            c["context"],
            c["rows"],
            f"{c['transformers_ms']:.1f}",
            f"{c['dspine_ms']:.1f}",
            f"{c['dspine_ms'] / c['transformers_ms']:.2f}",
            f"{c['transformers_over_step']:.2f}",
            f"{c['dspine_over_step']:.2f}",
        ]
        for c in cells
    ]
    header = [
        "context",
        "rows",
        "transformers ms",
        "dspine ms",
        "dspine / transformers",
        "tf / 1 row",
        "dspine / 1 row",
    ]
    md = md_table(header, rows) + f"\n{doc['git_sha']} · {doc['hardware']} · {doc['threads']} threads\n"
    atomic_write_text(out.with_suffix(".md"), md)
    print(md)


if __name__ == "__main__":
    main()
