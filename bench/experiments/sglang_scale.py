"""SGLang at the size users serve (CUDA; SGLang 0.5.17 with the dspine plugin): AR, DFlash and DSpine on a
target of a Qwen3-8B / Qwen3-4B shape (or a config file) with random weights, at forced acceptance lengths.

    python bench/kernels.py --hidden 4096 --batches 1 --dtypes bfloat16 --out /tmp/k8b.json
    python bench/experiments/sglang_scale.py --shape qwen3-8b --kernels /tmp/k8b.json \\
        --out bench/results/sglang_scale.json --summary bench/results/summary.json

Each server decodes exactly --max-new-tokens per request at concurrencies 1, 4, 16, 32; SGLANG_SIMULATE_ACC_LEN
forces the accepted length of every round (τ), so round costs are real measurements of the plugin at that τ.
With --profile N, DSpine's GPU kernels per round are set against DFlash's (SGLang's own profiler). Results
accumulate per shape in --out (a rerun skips the variants already measured with the same settings),
with a Markdown table beside it and the `speed_scale` section of --summary. The projection uses the real
target's τ from --summary's `acceptance` section and the paper's Qwen3-8B τ. See bench/experiments/shape_scale.py.
"""

import argparse
import json
import sys
from pathlib import Path

from shape_scale import SHAPES, ScaleConfig, run_scale  # beside this script

from dspine.config import ConfigError
from dspine.io import comma_ints


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", help=f"one of {', '.join(SHAPES)} or a CONFIG.json")
    ap.add_argument("--taus", type=floats, default=[2.0, 3.0, 4.8], help="forced τ, comma-separated")
    ap.add_argument("--concurrency", type=comma_ints, default=[1, 4, 16, 32])
    ap.add_argument("--methods", default="ar,dflash,dspine")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--per-benchmark", type=int, default=10, help="first-turn prompts per benchmark")
    ap.add_argument("--group", type=int, default=4, help="servers started side by side")
    ap.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="SGLang's --tp-size for every server (the plugin merges the ranks' vocabulary shards); above 1 "
        "give --group 1: one server holds every GPU",
    )
    ap.add_argument(
        "--attention-backend",
        default="triton",
        help="SGLang's attention backend for every server (triton; fa3 needs sgl_kernel's flash_ops.abi3.so)",
    )
    ap.add_argument("--tokenizer", help="folder with tokenizer.json (default: the built-in target's)")
    ap.add_argument("--work", default="/tmp/dspine-scale")
    ap.add_argument("--kernels", help="bench/kernels.py JSON at this width (injection, transition per round)")
    ap.add_argument("--out", default=None, help="JSON (default: WORK/sglang_scale.json); .md written beside it")
    ap.add_argument("--summary", help="summary.json: its --section is rewritten")
    ap.add_argument(
        "--section",
        default="speed_scale",
        help="the summary's section (speed_scale; e.g. speed_scale_long for a --max-new-tokens 2048 run at c=1)",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="per drafter server, N requests decoded at c=1 under SGLang's torch profiler: GPU kernels per round, "
        "DSpine against DFlash at each τ (0: none)",
    )
    ap.add_argument("--profile-tokens", type=int, default=128, help="tokens per profiled request")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args()
    measured = {}
    if a.summary and Path(a.summary).is_file():
        t0 = json.loads(Path(a.summary).read_text()).get("acceptance", {}).get("T0", {})
        measured = {m: t0[m] for m in ("dspine", "dflash") if m in t0}
    cfg = ScaleConfig(
        shape=a.shape,
        taus=a.taus,
        concurrencies=a.concurrency,
        methods=a.methods.split(","),
        max_new_tokens=a.max_new_tokens,
        per_benchmark=a.per_benchmark,
        group=a.group,
        tp=a.tp_size,
        attention_backend=a.attention_backend,
        tokenizer=a.tokenizer,
        work=a.work,
        out=a.out,
        summary=a.summary,
        section=a.section,
        kernels=a.kernels,
        measured_tau=measured,
        profile_requests=a.profile,
        profile_tokens=a.profile_tokens,
        progress=not a.no_progress,
    )
    try:
        whole = run_scale(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(Path(cfg.out or Path(a.work) / "sglang_scale.json").with_suffix(".md").read_text())
    return 0 if whole else 1


if __name__ == "__main__":
    sys.exit(main())
