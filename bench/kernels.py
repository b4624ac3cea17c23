"""Kernel benchmark (CUDA): fused Triton kernels vs their eager references at the real target's sizes.

Per speculative round at concurrency N: the injection over all drafter layers (kernels/injection.py, its
layouts "rows", "split" and "gemm", vs dspine.drafter.Injection) and the transition cache + greedy walk
(kernels/transition.py — fused and the s-wide "lowrank" — vs dspine.decoding.transition_scores + walk_greedy,
and "path": what greedy_transition_walk runs at this width), and the proposal head both methods
share — logits of slots 1..B-1 then DFlash's argmax or DSpine's top-K candidates (torch, or
kernels/candidates.py: fused, tiled). CUDA-event timing, median of repeated runs after warm-up, launched from Python
("launch") and replayed from a captured CUDA graph ("graph", as inside SGLang's draft graph, where launch
overhead is gone).
    python bench/kernels.py --out $OUT/kernels.json
Prints a table; writes JSON with the git sha, command and hardware.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from dspine.decoding import greedy_transition_walk, transition_scores, walk_greedy
from dspine.drafter import Injection, RMSNorm
from dspine.io import atomic_write_text, md_table, provenance, update_summary
from dspine.kernels.candidates import fused_top_candidates, tiled_top_candidates
from dspine.kernels.injection import VARIANTS, fused_injection, injection_variant
from dspine.kernels.transition import fused_transition_scores, fused_walk_greedy, lowrank_transition_scores


def timed(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def graphed(fn):
    """fn captured once into a CUDA graph -> a replay function (SGLang runs the draft step this way)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=576, help="drafter width d (default: SmolLM2-135M's 576)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument(
        "--vocab", type=int, default=49152, help="output-head rows (default: the built-in's 49152; Qwen3: 151936)"
    )
    ap.add_argument("--top-k", default="8", help="transition-cache widths K, comma-separated (default: 8)")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--out")
    ap.add_argument(
        "--summary",
        help="summary.json whose `kernels` section is rewritten (bf16, batch 1, graph "
        "replay: the setting of SGLang's draft step at concurrency 1)",
    )
    a = ap.parse_args()
    d, r, s, V = a.hidden, 256, 256, a.vocab  # the default transfer rank
    rows = []
    torch.manual_seed(0)
    for dt in a.dtypes.split(","):
        dtype = getattr(torch, dt)
        injs = [Injection(d, r, s).to("cuda", dtype) for _ in range(a.layers)]
        for inj in injs:
            for p in inj.parameters():
                torch.nn.init.normal_(p, std=0.05)
        norm = RMSNorm(d, 1e-6).to("cuda", dtype)
        head = torch.randn(V, d, device="cuda", dtype=dtype)
        codes = torch.randn(V, r, device="cuda")
        for N, K in [(n, k) for n in map(int, a.batches.split(",")) for k in map(int, a.top_k.split(","))]:
            B = a.block
            h = torch.randn(N, 1, B, d, device="cuda", dtype=dtype)
            anc = torch.randn(N, 1, r, device="cuda", dtype=dtype)
            h_pre = torch.randn(N, B, d, device="cuda", dtype=dtype)
            f = torch.randn(N, B, r, device="cuda", dtype=dtype)
            cand = torch.randint(0, V, (N, B - 1, K), device="cuda")
            slots = torch.randn(N, B - 1, d, device="cuda", dtype=dtype)
            variants = {
                "eager": lambda: [inj(h, anc) for inj in injs],
                "rows": lambda: [fused_injection(inj, h, anc, variant="rows") for inj in injs],
                "split": lambda: [fused_injection(inj, h, anc, variant="split") for inj in injs],
                "gemm": lambda: [fused_injection(inj, h, anc, variant="gemm") for inj in injs],
                "transition_eager": lambda: walk_greedy(
                    cand, transition_scores(injs[-1], norm, head, codes, h_pre, f, cand)
                ),
                "transition_fused": lambda: fused_walk_greedy(
                    cand, fused_transition_scores(injs[-1], norm, head, codes, h_pre, f, cand)
                ),
                "transition_lowrank": lambda: fused_walk_greedy(
                    cand, lowrank_transition_scores(injs[-1], norm, head, codes, h_pre, f, cand)
                ),
                # what the engine and the plugin run at this width (fused scores only up to the width rule)
                "transition_path": lambda: greedy_transition_walk(cand, injs[-1], norm, head, codes, h_pre, f),
                "head_argmax": lambda: torch.matmul(slots, head.t()).argmax(-1),
                "head_topk": lambda: torch.matmul(slots, head.t()).topk(K, dim=-1).indices,
                "head_topk_fused": lambda: fused_top_candidates(slots.view(-1, d), head, K),
                "head_topk_tiled": lambda: tiled_top_candidates(slots.view(-1, d), head, K),
            }
            row = {
                "dtype": dt,
                "batch": N,
                "block": B,
                "top_k": K,
                "layers": a.layers,
                "hidden": d,
                "vocab": V,
                "injection_path": injection_variant(width=d),
            }
            with torch.no_grad():
                for name, fn in variants.items():
                    row[f"{name}_launch_ms"] = timed(fn)
                    row[f"{name}_graph_ms"] = timed(graphed(fn))
            rows.append(row)
    cols = [
        *(f"{n}_{m}_ms" for n in ("eager", *VARIANTS) for m in ("launch", "graph")),
        "transition_eager_graph_ms",
        "transition_fused_graph_ms",
        "transition_lowrank_graph_ms",
        "transition_path_graph_ms",
        "head_argmax_graph_ms",
        "head_topk_graph_ms",
        "head_topk_fused_graph_ms",
        "head_topk_tiled_graph_ms",
    ]
    header = ["dtype", "batch", "K", *(c[:-3].replace("_", " ") for c in cols)]
    print(md_table(header, [[x["dtype"], x["batch"], x["top_k"], *(f"{x[c]:.3f}" for c in cols)] for x in rows]))
    meta = {**provenance(), "torch": torch.__version__}
    if a.out:
        atomic_write_text(Path(a.out), json.dumps({"rows": rows, **meta}, indent=1))
    one = [x for x in rows if x["dtype"] == "bfloat16" and x["batch"] == 1]
    if a.summary and one:
        x = one[0]
        best = x["injection_path"]
        update_summary(
            a.summary,
            "kernels",
            {
                "injection_ms_per_round": x[f"{best}_graph_ms"],
                "injection_variant": best,
                "injection_ms_per_round_by_variant": {v: x[f"{v}_graph_ms"] for v in ("eager", *VARIANTS)},
                "transition_ms_per_round": x["transition_path_graph_ms"],
                "transition_fused_ms_per_round": x["transition_fused_graph_ms"],
                "transition_eager_ms_per_round": x["transition_eager_graph_ms"],
                "candidates_over_argmax_ms_per_round": x["head_topk_graph_ms"] - x["head_argmax_graph_ms"],
                "candidates_fused_over_argmax_ms_per_round": x["head_topk_fused_graph_ms"] - x["head_argmax_graph_ms"],
                "setting": f"bf16, concurrency 1, {a.layers} injected layers, B={a.block}, K={x['top_k']}, "
                f"d={d}, r=s={r}, "
                f"V={V}; synthetic weights; replayed from a CUDA graph; CUDA events, median",
                **meta,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
