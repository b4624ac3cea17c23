"""Fine-tune a base drafter on collected agent traces — a Ray Train job (CPU or GPU workers).

    ray job submit --working-dir . -- python adapt/finetune.py --traces runs/traces --out runs/adapted \\
        --base builtin --workers 2 mode=lora per=workload train.steps=400 train.lr=1e-4

Settings are FinetuneConfig's fields (adapt/finetuning.py) as dotted overrides (`train.lr=3e-4`,
`modules_to_save=[]`, `levels=["low","high"]`); unknown keys are refused. One drafter per group (`per=all |
workload | workload_level`), each warm-started from --base, trained on the generated tokens of its training
episodes, checked on its held-out episodes, merged (LoRA) and written to OUT/<group>/ with OUT/finetune.json
naming the held-out episodes for adapt/evaluate.py. `--workers 0` trains in this process without Ray.
"""

import argparse
import json
import sys


def parse(argv=None):
    from dspine.adapt.finetuning import FinetuneConfig
    from dspine.config import configure

    p = argparse.ArgumentParser(
        prog="adapt/finetune.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--traces", required=True, help="collection directory (adapt/collect.py, dspine traces export)")
    p.add_argument("--out", required=True, help="output folder: one drafter per group + finetune.json")
    p.add_argument("--base", default="builtin", help="base drafter folder, or builtin (default)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target spec the base was trained for")
    p.add_argument("--workers", type=int, default=1, help="Ray Train workers (0: this process, no Ray)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per worker)")
    p.add_argument("overrides", nargs="*", help="dotted settings, e.g. mode=lora train.lr=1e-4 per=workload")
    a = p.parse_args(argv)
    return configure(
        FinetuneConfig,
        a.overrides,
        traces=a.traces,
        out=a.out,
        base=a.base,
        target=a.target,
        workers=a.workers,
        device=a.device,
    )


def main(argv=None) -> int:
    from dspine.adapt.finetuning import FinetuneError, finetune
    from dspine.checkpoint import CheckpointError
    from dspine.config import ConfigError

    try:
        cfg = parse(argv)
        res = finetune(cfg)
    except (ConfigError, FinetuneError, CheckpointError) as e:
        print(f"finetune: error: {e}", file=sys.stderr)
        return 2
    for g, info in res["groups"].items():
        last = info["last"] or {}
        print(
            json.dumps(
                {
                    "group": g,
                    "drafter": info["drafter"],
                    "train_samples": info["train_samples"],
                    "split": info["split"],
                    "parts": info["parts"],
                    "blend": info["blend"],
                    "step": last.get("step"),
                    "loss": last.get("loss"),
                    "processes": last.get("processes"),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
