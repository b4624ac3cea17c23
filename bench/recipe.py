"""GPU acceptance recipe (DESIGN.md §1.4: same data, steps, layers, block size and seed for every method).

On one H200, three commands (each under the device's 10-minute limit; /tmp survives between them):
    python bench/recipe.py --stage regen --work /tmp/recipe
    python bench/recipe.py --stage train --work /tmp/recipe
    python bench/recipe.py --stage eval --work /tmp/recipe --out $OUT/acceptance.json
Longer than one command: train.time_budget_s=880 train.stop_after_s=430, then the same with --resume.
Several GPUs: `torchrun --nproc_per_node N bench/recipe.py --stage train ...` trains data parallel (the
global batch split over the GPUs; same data and steps as one process — on 2 H200s a step took 0.19 s vs
0.21 s on one, so raise train.batch_size with N); the other stages stay one process.
The shipped base drafter: --base (then warm_from=<previous ship folder> to continue it, --ship DIR to write it).
The levers over DFlash (RecipeConfig.levers: slot 1's CE share, the cosine weight, slot 1 without the anchor's write,
the readouts' scale, 8 layers, each beside its DFlash twin in lockstep; evaluated by replay, 30 items x 512 tokens,
each ratio with a bootstrap interval): --levers, e.g.
    python bench/recipe.py --levers --stage eval --work /tmp/levers --out $OUT/ratio_levers.json
CPU-test size: python bench/recipe.py --tiny --stage all --work runs/tiny --out runs/tiny/acceptance.json
The curve across runs that continued one another: --stage curve --reports gpu3=A.json gpu4=B.json --out c.svg
The levers' replay evaluations of two seeds (train.seed=0 and 1) as one table, each ratio over both seeds with its
interval: --stage seeds --reports s0.json s1.json --out bench/results/ratio_levers.json [--summary ...]; or one
evaluation whose second seeds trained in the same lockstep (ablations NAME_s1 = NAME with "seed": 1):
--stage seeds --reports levers.json --out ...
Overrides: dotted keys of dspine.train.recipe.RecipeConfig, e.g. train.steps=800 layers=4.
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from dspine.config import apply_overrides, from_dict
from dspine.eval.replay import ReplayIncomplete, combine_seeds, split_seed_variants, write_replay_results
from dspine.io import atomic_write_text, update_summary
from dspine.train.recipe import (
    RecipeConfig,
    acceptance_summary,
    lineage_chart,
    run_eval_stage,
    run_regen_stage,
    run_train_stage,
    ship_drafters,
)


def curve(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    if not (a.reports and a.out):
        ap.error("--stage curve needs --reports and --out (an .svg)")
    named = [r.split("=", 1) if "=" in r else (Path(r).stem, r) for r in a.reports]
    reps = [json.loads(Path(path).read_text()) for _, path in named]
    reps = [r.get("train_report", r) for r in reps]  # an eval JSON holds its run's train report
    atomic_write_text(a.out, lineage_chart(reps, [name for name, _ in named]))
    print(a.out)
    return 0


def seeds(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    if not (a.reports and a.out):
        ap.error("--stage seeds needs --reports (replay evaluations of two or more seeds) and --out (a .json)")
    try:
        docs = [d for r in a.reports for d in split_seed_variants(json.loads(Path(r).read_text()))]
        doc = combine_seeds(docs)
    except (OSError, ValueError, KeyError) as e:
        ap.error(f"--stage seeds: {e}")
    write_replay_results(doc, a.out)
    print(Path(a.out).with_suffix(".md").read_text())
    if a.summary:
        update_summary(a.summary, "acceptance", acceptance_summary(doc))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=("regen", "train", "eval", "all", "curve", "seeds"), required=True)
    ap.add_argument("--work", help="folder for the dataset and the trained drafters (every stage but curve)")
    ap.add_argument(
        "--reports",
        nargs="+",
        metavar="JSON",
        help="curve: [NAME=]train report (or eval JSON) of runs that continued one another, oldest first; "
        "seeds: replay evaluations of one recipe under different train.seed",
    )
    ap.add_argument("--out", help="eval JSON (a .md table beside it)")
    ap.add_argument("--summary", help="summary.json whose acceptance section the eval stage rewrites")
    ap.add_argument("--tiny", action="store_true", help="the CPU-test-sized recipe")
    ap.add_argument("--base", action="store_true", help="the shipped base drafter's recipe (RecipeConfig.base_drafter)")
    ap.add_argument(
        "--levers", action="store_true", help="issue 50's levers beside their DFlash twins (RecipeConfig.levers)"
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="train stage: continue every drafter from WORK/<name>/last (after train.stop_after_s)",
    )
    ap.add_argument(
        "--ship", metavar="DIR", help="after training: each method's best drafter as it ships, to DIR/<method>/"
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.stage in ("curve", "seeds"):
        return (curve if a.stage == "curve" else seeds)(ap, a)
    if not a.work:
        ap.error("--work is needed for this stage")
    if sum((a.tiny, a.base, a.levers)) > 1:
        ap.error("--tiny, --base and --levers are presets: pick one")
    presets = {"tiny": RecipeConfig.cpu_tiny, "base": RecipeConfig.base_drafter, "levers": RecipeConfig.levers}
    preset = next((make() for k, make in presets.items() if getattr(a, k)), None) or RecipeConfig()
    base = asdict(preset)
    cfg = from_dict(RecipeConfig, apply_overrides(base, a.overrides), "recipe")
    if a.stage == "regen":
        print(json.dumps(run_regen_stage(cfg, a.work, progress=not a.no_progress), indent=1))
    if a.stage in ("train", "all"):
        rep = run_train_stage(cfg, a.work, progress=not a.no_progress, resume=a.resume)
        if not rep:  # torchrun, rank > 0: rank 0 reports and evaluates
            return 0
        print(json.dumps(rep, indent=1))
        if a.ship:
            print({m: str(p) for m, p in ship_drafters(cfg, a.work, a.ship).items()})
    if a.stage in ("eval", "all"):
        if not a.out:
            ap.error("--out is needed for the eval stage")
        try:
            doc = run_eval_stage(cfg, a.work, a.out, progress=not a.no_progress)
        except ReplayIncomplete as e:  # eval_budget_s ran out: what was replayed is kept for the next call
            print(f"eval stage incomplete: {e}", file=sys.stderr)
            return 3
        print(Path(a.out).with_suffix(".md").read_text())
        if a.summary:
            update_summary(a.summary, "acceptance", acceptance_summary(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
