"""`dspine export --to sglang`: a drafter checkpoint SGLang loads, validated name by name.

SGLang's DFlash draft model (srt/models/dflash.py) reads DFlash's config fields (`block_size`,
`num_target_layers`, `dflash_config.{mask_token_id,target_layer_ids}`) and backbone weights named
`layers.{i}.self_attn.{q,k,v,o}_proj`, `...q_norm/k_norm`, `...input_layernorm`, `...post_attention_layernorm`,
`...mlp.{gate,up,down}_proj`, `fc`, `hidden_norm`, `norm` — and silently skips any name it does not know. So
the export checks the written file against the exact expected set: a missing or extra name is an error.
DSpine's extras (`injections.{l}.*`, `transfer_codes`) are for the dspine plugin, which registers
`DSpineDraftModel`; a DFlash drafter is exported as SGLang's own `DFlashDraftModel`. The code table stays
fp32 (it is a lookup, not a matmul operand); everything else takes the export dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspine.checkpoint import CheckpointError, load_at, needs_target, save_drafter
from dspine.drafter import DSpineConfig, Injection

ARCHS = {"dflash": "DFlashDraftModel", "post_backbone": "DSpineDraftModel", "dspine": "DSpineDraftModel"}


class ExportError(CheckpointError):
    """An export SGLang would load wrongly."""


def sglang_weight_shapes(cfg: DSpineConfig) -> dict[str, tuple[int, ...]]:
    """Every weight name SGLang (+ the dspine plugin) expects for this config, with its shape."""
    d, hd, nh, nkv, ff, r, s = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        cfg.transfer_rank,
        cfg.message_size,
    )
    out = {"fc.weight": (d, len(cfg.target_layer_ids) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (nh * hd, d),
                p + "self_attn.k_proj.weight": (nkv * hd, d),
                p + "self_attn.v_proj.weight": (nkv * hd, d),
                p + "self_attn.o_proj.weight": (d, nh * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (ff, d),
                p + "mlp.up_proj.weight": (ff, d),
                p + "mlp.down_proj.weight": (d, ff),
            }
        )
    for layer in cfg.inject_layers:
        shapes = ((r, d), (r,), (s, r), (s,), (s, r), (s, r), (d, s))
        out.update({f"injections.{layer}.{n}": sh for n, sh in zip(Injection.PARAMS, shapes)})
    if cfg.uses_injection:
        out["transfer_codes"] = (cfg.vocab_size, r)
    return out


def validate_sglang_export(path: str | Path) -> dict:
    """Check an exported folder: config fields SGLang reads, and weight names/shapes exactly as expected."""
    from safetensors import safe_open

    path = Path(path)
    from dspine.checkpoint import config_from_json

    raw = json.loads((path / "config.json").read_text())
    # the exported architecture is SGLang's name; the rest parses as a dspine config
    cfg = config_from_json({**raw, "architectures": ["DSpineDraftModel"]})
    if raw.get("architectures") != [ARCHS[cfg.method]]:
        raise ExportError(
            f"{path}: architectures {raw.get('architectures')} for a {cfg.method} drafter, "
            f"expected {[ARCHS[cfg.method]]}"
        )
    if not 0 <= raw["dflash_config"]["mask_token_id"] < cfg.vocab_size:
        raise ExportError(f"{path}: mask_token_id outside the vocabulary")
    want = sglang_weight_shapes(cfg)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise ExportError(
            f"{path}: weight names differ from what SGLang loads: missing {missing[:6]}, "
            f"extra {extra[:6]} (SGLang would silently skip extras)"
        )
    bad = [f"{k}: {have[k]} vs {v}" for k, v in want.items() if have[k] != v]
    if bad:
        raise ExportError(f"{path}: weight shapes differ: {bad[:4]}")
    return {"architecture": raw["architectures"][0], "weights": len(have), "method": cfg.method}


def export_sglang(
    ckpt: str | Path,
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    top_k: int | None = None,
    target: str | None = None,
) -> dict:
    """`top_k`: the transition-cache width the server walks, when not the checkpoint's (decode-time only).
    `target` (a target spec): needed for a checkpoint shipped without its code table, recomputed from it."""
    tgt = None
    if target is not None and needs_target(ckpt):
        from dspine.target import load_target

        tgt = load_target(target)
    model = load_at(ckpt if top_k is None else (ckpt, {"top_k": top_k}), tgt)
    codes = model.transfer_codes.detach().clone() if model.config.uses_injection else None
    model = model.to(dtype)
    if codes is not None:
        model.transfer_codes = codes  # keep the lookup table fp32
    save_drafter(
        model,
        out,
        config_overrides={
            "architectures": [ARCHS[model.config.method]],
            "torch_dtype": str(dtype).replace("torch.", ""),
        },
    )
    try:
        return {**validate_sglang_export(out), "path": str(out)}
    except ExportError:
        import shutil

        shutil.rmtree(out, ignore_errors=True)  # never leave an export SGLang would load wrongly
        raise
