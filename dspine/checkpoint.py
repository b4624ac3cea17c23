"""Drafter checkpoints: `config.json` + `model.safetensors`, in DFlash's field names plus `dspine_config`.

    {"architectures": ["DSpineDraftModel"], "model_type": "qwen3", "hidden_size": ..., "block_size": 16,
     "num_target_layers": 30, "is_causal": false,
     "dflash_config": {"mask_token_id": 0, "target_layer_ids": [...]},
     "dspine_config": {"method": "dspine", "transfer_rank": 256, "message_size": 256, "top_k": 8}}

Loading is strict: unknown keys, missing or unexpected weights, mismatched shapes and unreadable files are
errors that name the problem. Only safetensors are read (no pickle). Saving writes a temp folder and
renames it into place, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dspine.config import ConfigError, from_dict
from dspine.drafter import DSPINE_SECTION, DSpineConfig, DSpineDraftModel
from dspine.io import atomic_dir
from dspine.methods import DRAFT_DTYPES
from dspine.packing import int8_linears_available

ARCH = "DSpineDraftModel"
_TOP = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_target_layers",
    "num_hidden_layers",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "block_size",
    "is_causal",
)
_DFLASH = ("mask_token_id", "target_layer_ids")
_FIXED = {
    "architectures": [ARCH],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
}
_IGNORED = (
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
    "auto_map",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "attention_dropout",
    "initializer_range",
    "rope_scaling",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
assert set(_TOP + _DFLASH + DSPINE_SECTION) == {f.name for f in fields(DSpineConfig)}


class CheckpointError(ValueError):
    """A checkpoint dspine cannot load."""


def config_to_json(cfg: DSpineConfig, dtype: torch.dtype = torch.float32) -> dict:
    out = dict(_FIXED)
    out.update({k: getattr(cfg, k) for k in _TOP})
    out["dflash_config"] = {k: getattr(cfg, k) for k in _DFLASH}
    out["dspine_config"] = {k: getattr(cfg, k) for k in DSPINE_SECTION}
    out["torch_dtype"] = str(dtype).replace("torch.", "")
    return out


def config_from_json(data: dict) -> DSpineConfig:
    data = dict(data)
    arch = data.pop("architectures", [ARCH])
    if arch != [ARCH]:
        raise CheckpointError(f"architectures is {arch}, expected [{ARCH!r}]")
    for k, v in _FIXED.items():
        if k in data and k != "architectures" and data.pop(k) != v:
            raise CheckpointError(f"{k} must be {v!r} for a DSpine drafter")
    for k in _IGNORED:
        data.pop(k, None)
    flat = {k: data.pop(k) for k in _TOP if k in data}
    for section, keys in (("dflash_config", _DFLASH), ("dspine_config", DSPINE_SECTION)):
        sec = data.pop(section, {}) or {}
        unknown = sorted(set(sec) - set(keys))
        if unknown:
            raise CheckpointError(f"config.json: unknown key(s) {unknown} in {section}")
        flat.update(sec)
    if data:
        raise CheckpointError(f"config.json: unknown key(s) {sorted(data)}")
    try:
        return from_dict(DSpineConfig, flat, "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def write_folder(path: str | Path, files: dict) -> Path:
    """Write a folder atomically: `files` maps a name to a callable(file path); temp folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(path.parent, os.W_OK):
        raise CheckpointError(f"cannot write a checkpoint under {path.parent}: permission denied")
    return atomic_dir(path, lambda tmp: [write(tmp / name) for name, write in files.items()])


DERIVED = ("transfer_codes",)  # buffers recomputed from the target at load time (dspine.transfer)


def save_drafter(
    model: DSpineDraftModel,
    path: str | Path,
    extra: dict | None = None,
    config_overrides: dict | None = None,
    dtype: torch.dtype | None = None,
    derived: bool = True,
) -> Path:
    """Write `path/config.json` and `path/model.safetensors` atomically (temp folder, then rename).
    `dtype` casts the weights (e.g. bf16 for a drafter that ships); `derived=False` leaves out what the
    target recomputes (DERIVED), which `load_drafter` then rebuilds."""
    state = {
        k: v.detach().to(dtype or v.dtype).contiguous().cpu()
        for k, v in model.state_dict().items()
        if derived or k not in DERIVED
    }
    dtype = next(iter(state.values())).dtype
    cfg = config_to_json(model.config, dtype)
    cfg.update(config_overrides or {})
    if extra:
        cfg["dspine_training"] = extra
    return write_folder(
        path,
        {
            "model.safetensors": lambda p: save_file(state, str(p), metadata={"format": "pt"}),
            "config.json": lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n"),
        },
    )


def read_config(path: str | Path) -> DSpineConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (not a drafter checkpoint)")
    try:
        data = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    data.pop("dspine_training", None)
    return config_from_json(data)


def load_drafter(
    path: str | Path, target=None, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> DSpineDraftModel:
    """Load a checkpoint; with `target`, check it was built for it and bind the target's embedding/head."""
    path = Path(path)
    cfg = read_config(path)
    wfile = path / "model.safetensors"
    if not wfile.is_file():
        others = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (found {others}: only safetensors are loaded)" if others else ""
        raise CheckpointError(f"{path}: no model.safetensors{hint}")
    try:
        state = load_file(str(wfile))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{wfile}: unreadable safetensors file ({e})") from None
    model = DSpineDraftModel(cfg)
    if target is not None:  # another target's drafter: say so before any weight check
        try:
            model.bind(target)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
    expected = model.state_dict()
    state.update(_derived(path, cfg, set(expected) - set(state), target))
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{wfile}: weights do not match the config (missing {missing[:6]}, unexpected {extra[:6]})"
        )
    bad = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if tuple(state[k].shape) != tuple(v.shape)
    ]
    if bad:
        raise CheckpointError(f"{wfile}: weight shapes do not match the config: {bad[:4]}")
    model.load_state_dict(state, strict=True)
    stored = next(v.dtype for k, v in state.items() if k not in DERIVED)
    if dtype == torch.qint8:  # int8 weights over fp32 activations (draft_dtype "int8")
        if torch.device(device).type != "cpu":
            raise CheckpointError(f"int8 drafting runs on the CPU only, not {device}")
        model = model.to(device=device, dtype=torch.float32).eval().decode_int8()
    else:
        model = model.to(device=device, dtype=dtype or stored).eval()
    return model.bind(target) if target is not None else model  # borrowed tensors in the final dtype


def needs_target(path: str | Path) -> bool:
    """Whether loading a checkpoint needs its target (it left out DERIVED buffers its config has); an unreadable
    checkpoint answers False, and loading it names the problem."""
    from safetensors import safe_open

    if not read_config(path).uses_injection:
        return False
    try:
        with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
            return not set(DERIVED) <= set(f.keys())
    except (SafetensorError, OSError):
        return False


def _derived(path: Path, cfg: DSpineConfig, absent: set[str], target) -> dict[str, torch.Tensor]:
    """The DERIVED buffers a checkpoint left out, rebuilt from the target."""
    absent = absent & set(DERIVED)
    if not absent:
        return {}
    if target is None:
        raise CheckpointError(f"{path}: holds no {sorted(absent)} (recomputed from the target): load it with a target")
    from dspine.transfer import build_transfer_space

    try:
        return {"transfer_codes": build_transfer_space(target.head_weight, cfg.transfer_rank).codes.cpu()}
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def resolve_drafter(spec: str | None, target: str, default: bool = False) -> str | None:
    """A --drafter value -> a checkpoint folder, or None for AR. "builtin" is the drafter that ships for the
    built-in `target`; "none" is no drafter; with `default`, an absent value means "builtin" when the target
    has a shipped drafter (and AR otherwise)."""
    from dspine.drafters import BUILTIN, builtin_drafter

    if spec is None:
        return str(builtin_drafter(target)) if default and target in BUILTIN else None
    if spec == "none":
        return None
    if spec == "builtin":
        try:
            return str(builtin_drafter(target))
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    return spec


DECODE_KNOBS = ("top_k",)  # drafter config fields that only decoding reads: a checkpoint serves any value


def load_at(
    spec, target=None, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> DSpineDraftModel:
    """A checkpoint folder, or (folder, {decode knob: value}) -> the drafter, e.g. decoded (or exported) with
    another transition-cache width than it was trained with."""
    path, knobs = (spec, {}) if isinstance(spec, (str, Path)) else spec
    bad = set(knobs) - set(DECODE_KNOBS)
    if bad:
        raise CheckpointError(f"{sorted(bad)} are not decode-time settings (those are {list(DECODE_KNOBS)})")
    d = load_drafter(path, target, dtype=dtype, device=device)
    if knobs and not d.config.transition_cache:
        raise CheckpointError(f"{path}: top_k is the transition-cache width; a {d.config.method} drafter has none")
    for k, v in knobs.items():
        setattr(d.config, k, v)
    d.config.validate()
    return d


def draft_dtype(name: str | None, target_dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype a drafter decodes in. Drafts need no exactness (the target verifies every token in its own
    dtype). "int8" (torch.qint8 here, as `load_drafter` takes it): int8 weights over fp32 activations, CPU only
    (packing.py). "auto": on a CPU, bfloat16 where it has native bf16 matrix instructions, else int8 — a half or
    a quarter of the bytes per draft and candidate head; the target's dtype elsewhere. None: the target's."""
    if name is None:
        return target_dtype
    if name not in DRAFT_DTYPES:
        raise CheckpointError(f"draft dtype {name!r} is not one of {list(DRAFT_DTYPES)}")
    if name == "int8":
        if torch.device(device).type != "cpu" or not int8_linears_available():
            raise CheckpointError("draft dtype int8 needs a CPU and torch's fbgemm quantized engine")
        return torch.qint8
    if name != "auto":
        return getattr(torch, name)
    if torch.device(device).type != "cpu":
        return target_dtype
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.qint8 if int8_linears_available() else target_dtype


def load_models(target_spec: str, dtype: str, device: str, drafters: dict, drafter_dtype: str | None = None) -> tuple:
    """-> (the target, {name: drafter bound to it}) from a target spec, a dtype name, a device and
    {name: checkpoint folder, or (folder, decode knobs) as `load_at` takes, or None (no model drafter: suffix
    drafting alone)}; `drafter_dtype` as `draft_dtype` takes it (None: the target's)."""
    from dspine.target import load_target

    dt = getattr(torch, dtype)
    target = load_target(target_spec, dtype=dt, device=device)
    ddt = draft_dtype(drafter_dtype, dt, device)
    return target, {n: load_at(p, target, ddt, device) if p is not None else None for n, p in drafters.items()}
