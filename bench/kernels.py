"""Kernel benchmark (CUDA): fused Triton kernels vs their eager references at the real target's sizes.

Per speculative round at concurrency N: the injection over all drafter layers (kernels/injection.py vs
dspine.drafter.Injection) and the transition cache + greedy walk (kernels/transition.py vs
dspine.decoding.transition_scores + walk_greedy). CUDA-event timing, median of repeated runs after warm-up.
    python bench/kernels.py --out $OUT/kernels.json
Prints a table; writes JSON with the git sha, command and hardware.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspine.decoding import transition_scores, walk_greedy  # noqa: E402
from dspine.drafter import Injection, RMSNorm  # noqa: E402
from dspine.evaluate import git_sha, hardware  # noqa: E402
from kernels.injection import fused_injection  # noqa: E402
from kernels.transition import fused_transition_scores, fused_walk_greedy  # noqa: E402


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--out")
    a = ap.parse_args()
    d, r, s, V = 576, 256, 256, 49152  # SmolLM2-135M's width and vocabulary, the default transfer rank
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
        for N in map(int, a.batches.split(",")):
            B, K = a.block, a.top_k
            h = torch.randn(N, 1, B, d, device="cuda", dtype=dtype)
            anc = torch.randn(N, 1, r, device="cuda", dtype=dtype)
            h_pre = torch.randn(N, B, d, device="cuda", dtype=dtype)
            f = torch.randn(N, B, r, device="cuda", dtype=dtype)
            cand = torch.randint(0, V, (N, B - 1, K), device="cuda")
            with torch.no_grad():
                inj_eager = timed(lambda: [inj(h, anc) for inj in injs])
                inj_fused = timed(lambda: [fused_injection(inj, h, anc) for inj in injs])
                tr_eager = timed(lambda: walk_greedy(cand, transition_scores(injs[-1], norm, head, codes, h_pre, f, cand)))
                tr_fused = timed(lambda: fused_walk_greedy(cand, fused_transition_scores(injs[-1], norm, head, codes,
                                                                                         h_pre, f, cand)))
            rows.append({"dtype": dt, "batch": N, "block": B, "top_k": K, "layers": a.layers,
                         "injection_eager_ms": inj_eager, "injection_fused_ms": inj_fused,
                         "transition_walk_eager_ms": tr_eager, "transition_walk_fused_ms": tr_fused})
    print("| dtype | batch | injection eager ms | fused ms | × | transition+walk eager ms | fused ms | × |")
    print("|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['dtype']} | {x['batch']} | {x['injection_eager_ms']:.3f} | {x['injection_fused_ms']:.3f} | "
              f"{x['injection_eager_ms'] / x['injection_fused_ms']:.1f} | {x['transition_walk_eager_ms']:.3f} | "
              f"{x['transition_walk_fused_ms']:.3f} | {x['transition_walk_eager_ms'] / x['transition_walk_fused_ms']:.1f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "git_sha": git_sha(), "hardware": hardware(),
                                           "command": " ".join(sys.argv), "torch": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
