"""Replay a fine-tune's held-out agent traces through the engine (base vs adapted, per workload × thinking
level, from the exact recorded token prefixes), run the general benchmarks, and gate.

    python adapt/evaluate.py --finetune runs/adapted --out bench/results/adapt.json --summary bench/results/summary.json

Writes OUT (JSON: per cell τ base / adapted / ratio, rounds, per-slot acceptance; general-benchmark τ and
regression; the gate's decision per adapted drafter) and OUT with .md; exit 0 when every adapted drafter
passes the gate, 3 when one is refused, 2 on bad input. Settings: EvalConfig (adapt/evaluation.py) as dotted
overrides, e.g. `limit=3 min_ratio=1.05 max_general_regression=0.02`.
"""

import argparse
import sys


def parse(argv=None):
    from dspine.adapt.evaluation import EvalConfig
    from dspine.config import configure

    p = argparse.ArgumentParser(
        prog="adapt/evaluate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--finetune", required=True, help="a fine-tune's output folder (holds finetune.json)")
    p.add_argument("--out", required=True, help="the evaluation JSON (a .md table is written beside it)")
    p.add_argument("--summary", default="", help="summary.json whose `adaptation` section is rewritten")
    p.add_argument("overrides", nargs="*", help="dotted settings, e.g. limit=3 min_ratio=1.05")
    a = p.parse_args(argv)
    return configure(EvalConfig, a.overrides, finetune=a.finetune, out=a.out, summary=a.summary)


def main(argv=None) -> int:
    from pathlib import Path

    from dspine.adapt.evaluation import evaluate_adaptation, markdown
    from dspine.checkpoint import CheckpointError
    from dspine.config import ConfigError

    try:
        cfg = parse(argv)
        if not (Path(cfg.finetune) / "finetune.json").is_file():
            raise ConfigError(f"{cfg.finetune}: no finetune.json (not a fine-tune's output folder)")
        doc = evaluate_adaptation(cfg)
    except (ConfigError, CheckpointError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    print(markdown(doc))
    return 0 if all(d["accept"] for d in doc["gate"].values()) else 3


if __name__ == "__main__":
    sys.exit(main())
