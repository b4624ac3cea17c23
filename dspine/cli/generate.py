"""`dspine generate`: one prompt through the engine, the reply and its acceptance."""

from __future__ import annotations

import json

from dspine.cli.common import (
    UsageError,
    add_draft_dtype,
    add_drafter,
    add_engine_options,
    add_target,
    drafter_dtype,
    engine_from_args,
    split_drafter_spec,
    torch_dtype,
)
from dspine.methods import METHODS


def add_generate(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="decode one prompt with the target alone or with a drafter",
        description="Decode a prompt with the target alone (--method ar) or speculatively with a "
        "drafter checkpoint, print the reply and its acceptance figures (tau = tokens "
        "committed per target verify round).",
    )
    add_target(g)
    add_draft_dtype(g)
    add_drafter(g, "builtin for the built-in target unless --method ar")
    add_engine_options(g)
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
    g.add_argument(
        "--json", action="store_true", help="print one JSON object (text, figures, token ids) instead of text"
    )


def cmd_generate(a) -> int:
    import torch

    from dspine.checkpoint import load_drafter, read_config, resolve_drafter
    from dspine.sampling import SamplingParams
    from dspine.target import load_target

    spec, suffix = split_drafter_spec(a.drafter)
    a.drafter = resolve_drafter(spec, a.target, default=a.method in (None, "dspine"))
    saved = read_config(a.drafter).method if a.drafter else None
    method = a.method or saved or "ar"
    if method != "ar" and not a.drafter:
        raise UsageError(f"--method {method} needs --drafter CHECKPOINT")
    if method != "ar" and saved != method:
        raise UsageError(f"checkpoint {a.drafter} is a {saved!r} drafter, not {method!r}")
    target = load_target(a.target, dtype=torch_dtype(a.dtype), device=a.device)
    drafter = None
    if method != "ar":
        drafter = load_drafter(a.drafter, target, dtype=drafter_dtype(a, target), device=a.device)
    engine = engine_from_args(a, target, drafter, suffix)
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
        print(json.dumps({"text": res.text, **figures, "token_ids": res.token_ids}))
    else:
        print(res.text)
        print("---")
        print(" ".join(f"{k}={v}" for k, v in figures.items() if k != "per_slot"))
        if res.stats is not None:
            print("per-slot acceptance:", " ".join(f"{x:.2f}" for x in res.stats.per_slot))
    return 0
