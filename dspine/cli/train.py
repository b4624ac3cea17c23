"""`dspine train` (a drafter from regenerated data) and `dspine export` (a checkpoint SGLang loads)."""

from __future__ import annotations

import json

from dspine.cli.common import UsageError, add_target, torch_dtype
from dspine.methods import METHODS


def add_train(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train a drafter on target-regenerated responses",
        description="Train a drafter on a `dspine regen` dataset (or, without --data, on a few "
        "prompts regenerated on the spot) and save out/best and out/last. Training "
        "settings are dotted overrides, e.g. train.lr=3e-4 train.steps=500. --resume "
        "continues out/last exactly (optimizer, RNG, data position); --warm-start "
        "copies only the weights of another checkpoint. On several GPUs run it under "
        "`torchrun --nproc_per_node N -m dspine.cli train --data ...`: data parallel, "
        "the same batches and steps as one process.",
    )
    add_target(t)
    t.add_argument("--method", choices=METHODS[1:], default="dspine", help="drafter variant (default: %(default)s)")
    t.add_argument("--out", required=True, help="run folder: best/, last/, log.jsonl")
    t.add_argument("--data", help="regen dataset folder (part-*.parquet)")
    t.add_argument(
        "--workload",
        default="sharegpt",
        help="without --data: prompts to regenerate into OUT/data (default: %(default)s)",
    )
    t.add_argument("--num-prompts", type=int, default=32, help="without --data: prompts (default: %(default)s)")
    t.add_argument(
        "--max-new-tokens", type=int, default=96, help="without --data: response length (default: %(default)s)"
    )
    t.add_argument("--layers", type=int, default=5, help="drafter layers (default: %(default)s)")
    t.add_argument("--block-size", type=int, default=16, help="block size B (default: %(default)s)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from out/last")
    t.add_argument("--warm-start", help="checkpoint whose weights initialise the drafter (same shapes)")
    t.add_argument("--no-progress", action="store_true", help="hide progress bars")
    t.add_argument(
        "overrides",
        nargs="*",
        metavar="train.KEY=VALUE",
        help="dotted overrides of the training config (keys: see dspine.train.TrainConfig)",
    )


def add_export(sub) -> None:
    x = sub.add_parser(
        "export",
        help="write a drafter checkpoint that SGLang loads",
        description="Export a drafter for SGLang: DFlash's config fields and weight names "
        "(DFlashDraftModel for a dflash drafter, DSpineDraftModel — registered by the "
        "dspine SGLang plugin — otherwise), in the chosen dtype, validated so that a "
        "missing or extra weight name is an error (SGLang itself would skip it).",
    )
    x.add_argument("--to", choices=("sglang",), default="sglang", help="the serving stack (default: %(default)s)")
    x.add_argument(
        "--drafter", required=True, help="drafter checkpoint folder, or 'builtin' (the built-in target's drafter)"
    )
    x.add_argument(
        "--target",
        default="smollm2-135m-instruct",
        help="the drafter's target: 'builtin' resolves for it, and a drafter shipped without its code table "
        "has it recomputed from it (default: %(default)s)",
    )
    x.add_argument("--out", required=True, help="export folder (written atomically)")
    x.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="weights' dtype (default: %(default)s; the code table stays fp32)",
    )
    x.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="transition-cache width K the server walks (a decode-time setting; default: the checkpoint's)",
    )


def cmd_train(a) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from dspine.config import apply_overrides, from_dict
    from dspine.target import load_target
    from dspine.train.data import load_samples, regenerate_dataset, workload_items
    from dspine.train.loop import TrainConfig, init_distributed
    from dspine.train.run import DrafterSpec, run

    over = apply_overrides({"train": {}}, a.overrides)
    if set(over) != {"train"}:
        raise UsageError(f"overrides must start with 'train.', got sections {sorted(set(over) - {'train'})}")
    cfg = from_dict(TrainConfig, {**asdict(TrainConfig(gamma=7.0 * a.block_size / 16)), **over["train"]}, "train")
    if a.resume and a.warm_start:
        raise UsageError("--resume continues a run; --warm-start begins a new one: pick one")
    out = Path(a.out)
    if a.resume and not (out / "last" / "trainer_state.json").is_file():
        raise UsageError(f"--resume: {out / 'last'} holds no trainer state")
    pairs = load_samples(a.data) if a.data else None  # fail on a missing dataset before loading the target
    rank, world = init_distributed(a.device)  # torchrun: data parallel (dspine.train.loop)
    if world > 1 and pairs is None:
        raise UsageError("under torchrun, regenerate first (`dspine regen`) and pass --data")
    target = load_target(a.target, dtype=torch_dtype(a.dtype), device=a.device)
    if pairs is None:  # regenerate a few prompts on the spot, into out/data
        items = workload_items(a.workload, limit=a.num_prompts, max_chars=600)
        regenerate_dataset(
            target, items, out / "data", max_new_tokens=a.max_new_tokens, batch_size=8, progress=not a.no_progress
        )
        pairs = load_samples(out / "data")
    out.mkdir(parents=True, exist_ok=True)
    rep = run(
        target,
        pairs,
        {a.method: DrafterSpec(method=a.method)},
        {a.method: out},
        cfg,
        layers=a.layers,
        block_size=a.block_size,
        heldout=max(1, min(64, len(pairs) // 8)),
        resume=a.resume,
        warm_from=a.warm_start,
        rank=rank,
        progress=not a.no_progress,
        log_path=out / "log.jsonl",
        extra={"target": a.target, "data": a.data},
    )
    if rank == 0:
        r = rep["methods"][a.method]
        print(
            f"saved {a.method} drafter to {out}/best and {out}/last: held-out tau_sim {r['tau_sim_before']:.3f} -> "
            f"{r['tau_sim_after']:.3f}"
        )
    return 0


def cmd_export(a) -> int:
    from dspine.checkpoint import resolve_drafter
    from dspine.sglang.export import export_sglang

    print(
        json.dumps(
            export_sglang(
                resolve_drafter(a.drafter, a.target), a.out, torch_dtype(a.dtype), top_k=a.top_k, target=a.target
            )
        )
    )
    return 0
