"""`dspine bench` (speed of AR and drafters side by side, engine or SGLang) and `dspine eval` (acceptance per
benchmark)."""

from __future__ import annotations

import argparse

from dspine.cli.common import (
    TARGET_DTYPES,
    UsageError,
    add_target,
    benchmark_names,
    drafter_specs,
    dtype_tag,
    load_models,
)
from dspine.methods import DRAFT_DTYPES


def add_bench(sub) -> None:
    bn = sub.add_parser(
        "bench",
        help="speed of AR and drafters (embedded engine or SGLang), side by side",
        description="Decode benchmark prompts with AR and each drafter in one run and report "
        "tokens/s, the ratio to AR, tau and the cost of a speculative round against an AR "
        "step. engine: concurrency 1, the round split into draft forward (injection "
        "included), propose (transition cache + walk), target verify and commit. sglang: "
        "one SGLang server per method (DSpine drafters through the dspine plugin, "
        "installed with dspine), at each --concurrency, with per-benchmark tau and the "
        "greedy match rate against AR. A dspine checkpoint given to --backend sglang is "
        "exported for SGLang first (bf16).",
    )
    add_target(bn, several_dtypes=True)
    bn.add_argument(
        "--draft-dtype",
        default="auto",
        help="dtype(s) the drafters decode in, comma-separated to compare them side by side (each drafter then "
        "reported as NAME/DTYPE): auto (on a CPU bfloat16 with native bf16 instructions, else int8; elsewhere "
        "--dtype), float32, bfloat16, float16, int8 (CPU: int8 weights, fp32 activations) (default: %(default)s)",
    )
    bn.add_argument(
        "--backend",
        choices=("engine", "sglang"),
        default="engine",
        help="engine: the embedded engine (default); sglang: SGLang servers with the dspine plugin",
    )
    bn.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="a drafter to measure (repeatable): SPEC a checkpoint, builtin, suffix (suffix drafting alone) or "
        "CHECKPOINT+suffix (the hybrid); AR is always measured in the same run",
    )
    bn.add_argument("--benchmarks", default="gsm8k,mt_bench", help="comma-separated (default: %(default)s)")
    bn.add_argument("--limit", type=int, default=4, help="items per benchmark (default: %(default)s)")
    bn.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    bn.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="engine: 0 = greedy (default); above 0 every request samples, seeded by its index, and the rows' "
        "match with AR is a rate, not a guarantee (the same distribution, other draws)",
    )
    bn.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated concurrencies (default: 1,4,16,32 for sglang, 1 for the engine, which "
        "decodes groups of c requests together)",
    )
    bn.add_argument(
        "--sglang-dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="sglang: serving dtype (default: %(default)s)",
    )
    bn.add_argument(
        "--sglang-flags",
        default=None,
        help="sglang: launch_server flags for every server, one string (default: triton attention, "
        "torch sampling, no radix cache, decode CUDA graphs for batch 1, 2, 4, ..., 32, no prefill "
        "CUDA graph)",
    )
    bn.add_argument("--out", help="JSON file to write (a .md table beside it; SGLang logs in its folder)")
    bn.add_argument(
        "--draft-lens",
        help="engine: measure each drafter at each of these drafts per round (comma-separated, each in "
        "1..block-1; rows NAME/dD); D:S also runs only S of the drafter's block slots (D+1..block; rows "
        "NAME/dDbS), D:S:M (or D::M) drafts only in rounds of at most M open requests (serve's "
        "--spec-max-batch; rows NAME/dDbSmM), D:S:g by goodput (serve's --draft-policy goodput; rows NAME/dDbSg); "
        "D may be tTREE, a draft tree (see --draft-tree; rows NAME/tTREE...); "
        "default: the whole block",
    )
    bn.add_argument(
        "--engine-agreement",
        type=int,
        default=0,
        metavar="WORKERS",
        help="sglang: afterwards decode SGLang's own concurrency-1 outputs again with dspine's engine "
        "(the same text, drafts accepted while they match it) in WORKERS processes on "
        "--device/--dtype, and report τ per benchmark from both and their ratio (default: off)",
    )
    bn.add_argument(
        "--agreement-drafters",
        default="dspine",
        help="sglang: comma-separated drafters the engine replays for --engine-agreement (default: %(default)s)",
    )
    bn.add_argument(
        "--sglang-serial-start",
        action="store_true",
        help="sglang: start each server after the previous one stopped (default: all start side by "
        "side, then run one at a time; needs flags that let several share the GPU)",
    )
    bn.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="sglang: an environment variable for one method's server only (repeatable; NAME is a "
        "--drafter name or ar), e.g. the same checkpoint twice with "
        "dspine_torch:DSPINE_CANDIDATES=torch to compare a kernel switch on one GPU in one run",
    )
    bn.add_argument(
        "--summary",
        help="summary.json whose section is rewritten: `speed` for sglang (needs drafters named dspine and "
        "dflash), `cpu` for the engine",
    )
    bn.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_eval(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="acceptance per benchmark for AR and any set of drafters",
        description="Decode benchmark prompts through the engine with AR and each drafter, at each "
        "temperature; write JSON (git sha, command, hardware, config hashes) and a "
        "Markdown table beside it. At T=0 every drafter's output is checked against AR.",
    )
    add_target(e)
    e.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="a drafter to evaluate (repeatable), e.g. dspine=runs/a/best, hybrid=builtin+suffix, lookup=suffix",
    )
    e.add_argument(
        "--benchmarks",
        default="all",
        help="comma-separated from gsm8k,math500,humaneval,mbpp,livecodebench,mt_bench,arena_hard (default: all)",
    )
    e.add_argument("--limit", type=int, default=10, help="items per benchmark (default: %(default)s)")
    e.add_argument("--temperatures", default="0,1", help="comma-separated (default: %(default)s)")
    e.add_argument("--max-new-tokens", type=int, default=256, help="per turn (default: %(default)s)")
    e.add_argument(
        "--turns",
        type=int,
        default=None,
        help="ask at most this many turns of multi-turn items (default: all; 1 matches a single-turn "
        "server benchmark such as `dspine bench --backend sglang`)",
    )
    e.add_argument(
        "--draft-tree",
        action="append",
        default=[],
        metavar="NAME=TREE",
        help="rounds of drafter NAME verify this draft tree instead of the chain of block_size - 1 drafts "
        "(repeatable; see `dspine generate --help` for TREE), e.g. --drafter chain=builtin --drafter "
        "tree=builtin --draft-tree tree=000000000000000.1.01 compares both in one run",
    )
    e.add_argument("--out", required=True, help="JSON file to write (a .md table is written beside it)")
    e.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    e.add_argument(
        "--workers",
        type=int,
        default=1,
        help="engine processes sharing the device (results identical to 1; several help on a GPU, "
        "where one batch-1 engine is launch-bound) (default: %(default)s)",
    )


def cmd_bench(a) -> int:
    import shlex
    from pathlib import Path

    from dspine.eval.bench import bench_table, engine_bench
    from dspine.io import atomic_write_text, json_text

    benches = benchmark_names(a.benchmarks)
    if a.limit <= 0 or a.max_new_tokens <= 0:
        raise UsageError("--limit and --max-new-tokens must be positive")
    dtypes = [x for x in a.dtype.split(",") if x]
    if not dtypes or any(x not in TARGET_DTYPES for x in dtypes) or len(set(dtypes)) < len(dtypes):
        raise UsageError(f"--dtype {a.dtype!r}: distinct values from {list(TARGET_DTYPES)}, comma-separated")
    if len(dtypes) > 1 and a.backend == "sglang":
        raise UsageError("--dtype: one dtype with --backend sglang (its servers take --sglang-dtype)")
    if not a.temperature >= 0 or (a.temperature and a.backend == "sglang"):
        raise UsageError(f"--temperature {a.temperature}: >= 0, and 0 with --backend sglang")
    a.dtype = dtypes[0]
    specs, suffix = drafter_specs(a.drafter, a.target)
    conc = _concurrencies(a.concurrency or ("1,4,16,32" if a.backend == "sglang" else "1"))
    if a.backend == "sglang":
        from dspine.sglang.bench import SGLangBenchConfig, run_sglang_bench

        cfg = SGLangBenchConfig(
            target=a.target,
            dtype=a.dtype,
            device=a.device,
            limit=a.limit,
            max_new_tokens=a.max_new_tokens,
            sglang_dtype=a.sglang_dtype,
            flags=shlex.split(a.sglang_flags) if a.sglang_flags is not None else None,
            out=a.out,
            summary=a.summary,
            engine_agreement=a.engine_agreement,
            agreement_drafters=[n for n in a.agreement_drafters.split(",") if n],
            parallel_start=not a.sglang_serial_start,
            server_env=a.server_env,
            progress=not a.no_progress,
        )
        if suffix:
            raise UsageError("suffix drafting runs in the embedded engine (--backend engine); SGLang has its own NGRAM")
        doc = run_sglang_bench(cfg, benches, specs, conc)
    else:
        asked = vars(a).copy()  # _bench_models narrows a.draft_dtype to its first
        target, drafters = _bench_models(a, specs)
        others = {dtype_tag(x): _bench_models(argparse.Namespace(**{**asked, "dtype": x}), specs) for x in dtypes[1:]}
        doc = engine_bench(
            target,
            drafters,
            benches,
            a.limit,
            a.max_new_tokens,
            temperature=a.temperature,
            progress=not a.no_progress,
            concurrencies=conc,
            draft_lens=_draft_lens(a.draft_lens) if a.draft_lens else None,
            other_targets=others,
            suffix=suffix,
        )
        if a.summary:
            from dspine.eval.bench import cpu_summary
            from dspine.io import update_summary

            update_summary(a.summary, "cpu", cpu_summary(doc))
    table = bench_table(doc)
    if a.out:
        atomic_write_text(Path(a.out), json_text(doc))
        atomic_write_text(Path(a.out).with_suffix(".md"), table)
    print(table)
    return 0


def _bench_models(a, specs: dict[str, str]):
    """The target and each drafter at every --draft-dtype (named NAME/DTYPE when several are compared)."""
    from dspine.checkpoint import draft_dtype, load_at

    names = [x for x in a.draft_dtype.split(",") if x]
    bad = [x for x in names if x not in DRAFT_DTYPES]
    if not names or bad:
        raise UsageError(f"--draft-dtype {a.draft_dtype!r}: each must be one of {list(DRAFT_DTYPES)}")
    a.draft_dtype = names[0]
    target, drafters = load_models(a, specs)
    if len(names) == 1:
        return target, drafters
    out = {}
    for x in names:
        dt = draft_dtype(x, target.dtype, a.device)
        tag = dtype_tag(str(dt))
        for n, d in drafters.items():
            out[f"{n}/{tag}"] = d if d is None or d.decode_dtype == dt else load_at(specs[n], target, dt, a.device)
    return target, out


def _draft_lens(text: str) -> list[int | tuple]:
    """--draft-lens "8,3,3:4,3:4:2" -> [8, 3, (3, 4, None), (3, 4, 2)]: drafts per round, then optionally the
    block slots run and the most open requests a round drafts for (engine_bench)."""
    from dspine.decoding import DraftTree

    out: list[int | tuple] = []
    for x in text.split(","):
        parts = x.split(":")
        tree = parts[0][1:] if parts[0].startswith("t") else None
        if tree is not None:
            try:
                tree = str(DraftTree.parse(tree))
            except ValueError as e:
                raise UsageError(f"--draft-lens {x!r}: {e}") from None
            parts[0] = "1"  # checked below like a draft length
        goodput = len(parts) == 3 and parts[2] == "g"
        try:
            ints = [int(p) if p else None for p in parts[: 2 if goodput else len(parts)]]
            d, s, m = ints + [None] * (3 - len(ints))
        except ValueError:  # not integers, or more than three parts
            raise UsageError(f"--draft-lens {x!r} is not D, D:S or D:S:M (integers, M or g; D may be tTREE)") from None
        if d is None or min(v for v in (d, s, m) if v is not None) < 1:
            raise UsageError(f"--draft-lens {x!r}: D, S and M must be integers >= 1")
        m = "g" if goodput else m
        d = tree or d
        out.append((d, s, m) if len(parts) > 1 or tree else d)
    return out


def _concurrencies(text: str) -> list[int]:
    try:
        conc = sorted({int(c) for c in text.split(",")})
    except ValueError:
        raise UsageError(f"--concurrency {text!r} is not a comma-separated list of integers") from None
    if conc[0] < 1:
        raise UsageError("--concurrency values must be >= 1")
    return conc


def cmd_eval(a) -> int:
    import os

    from dspine.eval.acceptance import check_trees, evaluate, markdown_table, write_results

    benches = benchmark_names(a.benchmarks)
    temps = [float(t) for t in a.temperatures.split(",")]
    if any(t < 0 for t in temps) or a.limit <= 0 or a.max_new_tokens <= 0:
        raise UsageError("temperatures must be >= 0, --limit and --max-new-tokens positive")
    if a.workers < 1:
        raise UsageError("--workers must be >= 1")
    if a.turns is not None and a.turns < 1:
        raise UsageError("--turns must be >= 1")
    specs, suffix = drafter_specs(a.drafter, a.target)
    trees = {}
    for t in a.draft_tree:
        name, sep, spec = t.partition("=")
        if not sep or name not in specs:
            raise UsageError(f"--draft-tree {t!r}: NAME=TREE with NAME one of the --drafter names ({', '.join(specs)})")
        trees[name] = spec
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.access(out_dir if os.path.isdir(out_dir) else os.path.dirname(out_dir), os.W_OK):
        raise UsageError(f"cannot write {a.out}")
    target, drafters = load_models(a, specs)
    try:
        trees = check_trees(drafters, trees)  # before any decoding
    except ValueError as e:
        raise UsageError(str(e)) from None
    doc = evaluate(
        target,
        drafters,
        benches,
        a.limit,
        temps,
        a.max_new_tokens,
        progress=not a.no_progress,
        workers=a.workers,
        target_spec=(a.target, a.dtype, a.device),
        drafter_paths=specs,
        max_turns=a.turns,
        trees=trees,
        suffix=suffix,
    )
    write_results(doc, a.out)
    print(markdown_table(doc))
    return 0
