"""DSpine draft model: DFlash backbone + gated adjacent injection through depth.

Design choices
- Backbone = DFlash: Qwen3-style layers (RMSNorm, per-head q/k norm, RoPE at the target's absolute
  positions, SwiGLU) of the target's width. Context features c_j = RMSNorm(fc([h_j^(l1); ...; h_j^(lm)]))
  enter every layer only as extra keys/values (through that layer's k/v projections), never the residual.
  The block is [anchor, mask, ..., mask]; block queries see all context keys and all block keys
  (bidirectional, or causal with `is_causal`). The drafter owns no vocabulary: the target's embedding and
  head are bound at run time (`bind`) and never trained or saved.
- DSpine: a fixed whitened PCA code table T (transfer.py, a buffer). After every injected layer l a readout
  f = R_l rms(h) (parameter-free RMS so the gate sees a scale-stable feature) and, for slots t >= 1, a
  gated message from the predecessor p_t (f_{t-1}, or T[x_0] for slot 1):
  h_t += W_l(σ(A f_t + P p_t + b) ⊙ M p_t), W_l zero-initialised (so an untrained write is DFlash).
  All slots read pre-update features: one parallel update per layer, the causal chain unfolds over depth.
- Variants are config flags (`VARIANTS`): dspine injects after every layer, post_backbone after the last
  only, dflash never; the transition cache (decoding.py) is on whenever the last layer injects.
- On CUDA at inference the injection runs as one fused Triton kernel per layer (kernels/injection.py; this
  file's `Injection` is its reference); training and CPUs use the reference. On a CPU the drafter may decode
  through int8 copies of its linears and of the candidate head (`decode_int8`, packing.py); its weights stay as
  trained and saved.
- One forward serves inference (one block per row, context K/V from a cache) and training (many blocks
  per sequence in one attention call under a block mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from dspine import kernels
from dspine.config import ConfigError
from dspine.methods import VARIANTS
from dspine.packing import linear, pack_linears


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """m = L layers spaced evenly over [1, L_T - 3] (DFlash's choice)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if num_draft_layers == 1:
        return [(lo + hi) // 2]
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# ---------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DSpineSection:
    """The DSpine settings: config.json's `dspine_config` section, read by the drafter (DSpineConfig extends it)
    and by the SGLang plugin from an export (unknown keys are an error)."""

    method: str = "dspine"
    transfer_rank: int = 256
    message_size: int = 256
    top_k: int = 8
    # False: slot 1 gets no write from the anchor (its code is taken as zero, so the gated message is zero) — a
    # target with tied embeddings already gives slot 0 the anchor's head row, which the code repeats
    anchor_write: bool = True


DSPINE_SECTION = tuple(f.name for f in fields(DSpineSection))  # config.json's dspine_config keys


@dataclass
class DSpineConfig(DSpineSection):
    """The drafter: its backbone (the target's width), DFlash's block, and the DSpine section (keyword-only)."""

    # backbone (Qwen3-style, the target's width)
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    num_hidden_layers: int = 5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    # DFlash block
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    is_causal: bool = False

    def __post_init__(self):
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)

    def validate(self) -> None:
        if self.method not in VARIANTS:
            raise ConfigError(f"method {self.method!r} is not one of {sorted(VARIANTS)}")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary ({self.vocab_size})")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ConfigError(f"target_layer_ids {bad} outside [0, {self.num_target_layers})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.uses_injection and not 1 <= self.transfer_rank <= min(self.hidden_size, self.vocab_size - 1):
            raise ConfigError(f"transfer_rank {self.transfer_rank} must be in [1, hidden_size]")
        if self.uses_injection and (self.message_size < 1 or not 1 <= self.top_k <= self.vocab_size):
            raise ConfigError("message_size must be >= 1 and top_k in [1, vocab_size]")

    @property
    def inject_layers(self) -> list[int]:
        mode = VARIANTS[self.method]
        n = self.num_hidden_layers
        return list(range(n)) if mode == "all" else [n - 1] if mode == "last" else []

    @property
    def uses_injection(self) -> bool:
        return VARIANTS.get(self.method, "none") != "none"

    @property
    def transition_cache(self) -> bool:
        return self.uses_injection  # the last layer always injects when any does


# ---------------------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op (a draft is many small ones)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_angles(pos: torch.Tensor, hd: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """pos (N, Q) -> (cos, sin) each (N, 1, Q, hd) fp32: computed once per forward, shared by every layer."""
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=pos.device, dtype=torch.float32) / hd))
    ang = pos.to(torch.float32)[:, None, :, None] * inv  # (N, 1, Q, hd/2)
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (N, H, Q, hd), cs = rope_angles(pos) -> rotated (neox half-split, as HF Llama/Qwen3)."""
    cos, sin = cs
    x1, x2 = x.float().chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rot * sin).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DSpineConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(d, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, n, d), cs = rope_angles of positions (N, n) -> k, v (N, Hkv, n, hd), k normed and rotated."""
        N, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, n, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(N, n, self.nkv, self.hd).transpose(1, 2)
        return rope(k, cs), v

    def forward(
        self,
        x: torch.Tensor,
        cs: tuple[torch.Tensor, torch.Tensor],
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x (N, Q, d) block slots; cs = rope_angles of their positions; ctx_k/v (N, Hkv, C, hd); mask
        (N, 1, Q, C + Q) bool or None (all visible)."""
        N, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, Q, self.nh, self.hd)).transpose(1, 2)
        q = rope(q, cs)
        k, v = self.kv(x, cs)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=2)
        v = torch.cat([ctx_v.to(v.dtype), v], dim=2)
        rep = self.nh // self.nkv
        if rep > 1 and x.device.type == "cpu":  # shared K/V heads inside the CPU kernel: several times faster
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:  # CUDA's memory-efficient kernel (masks, training) takes no enable_gqa: it would fall back to math
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(N, Q, self.nh * self.hd))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DSpineConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DSpineConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, h, cs, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), cs, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Injection(nn.Module):
    PARAMS = (
        "readout.weight",
        "readout.bias",
        "gate_f.weight",
        "gate_f.bias",
        "gate_p.weight",
        "message.weight",
        "write.weight",
    )  # its weight names, in the order the SGLang export and plugin list them

    """Readout + gated adjacent write for one layer (the eager reference for kernels/injection)."""

    def __init__(self, d: int, r: int, s: int):
        super().__init__()
        self.readout = nn.Linear(d, r, bias=True)  # R_l (init: PCA projection, centred)
        self.gate_f = nn.Linear(r, s, bias=True)  # A, b
        self.gate_p = nn.Linear(r, s, bias=False)  # P
        self.message = nn.Linear(r, s, bias=False)  # M
        self.write = nn.Linear(s, d, bias=False)  # W_l, zero-initialised
        nn.init.zeros_(self.write.weight)

    def read(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., d) -> f (..., r)."""
        return self.readout(F.rms_norm(h, (h.shape[-1],)))

    def delta(self, f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Successor feature f (..., r), predecessor p (..., r) -> residual write (..., d)."""
        return self.write(torch.sigmoid(self.gate_f(f) + self.gate_p(p)) * self.message(p))

    def forward(self, h: torch.Tensor, anchor_code: torch.Tensor):
        """h (N, nb, B, d), anchor_code (N, nb, r) -> (h updated, f (N, nb, B, r))."""
        f = self.read(h)
        p = torch.cat([anchor_code[:, :, None], f[:, :, 1:-1]], dim=2)  # predecessors of slots 1..B-1
        upd = h[:, :, 1:] + self.delta(f[:, :, 1:], p)
        return torch.cat([h[:, :, :1], upd], dim=2), f


# ---------------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------------
@dataclass
class DraftOutput:
    hidden: torch.Tensor  # (N, nb, B, d) after the last layer (and its write)
    h_pre: torch.Tensor | None  # (N, nb, B, d) before the last layer's write
    feats: dict[int, torch.Tensor]  # layer -> readout f (N, nb, B, r)


class DSpineDraftModel(nn.Module):
    def __init__(self, cfg: DSpineConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.injections = nn.ModuleDict(
            {str(i): Injection(d, cfg.transfer_rank, cfg.message_size) for i in cfg.inject_layers}
        )
        if cfg.uses_injection:
            self.register_buffer("transfer_codes", torch.zeros(cfg.vocab_size, cfg.transfer_rank))
        self.apply(self._init_weights)
        self._embed: torch.Tensor | None = None  # (V, d) target input embedding, bound at run time
        self._head: torch.Tensor | None = None  # (V, d) target output head
        self._source: int | None = None  # data pointer of the target embedding the two above were taken from
        pack_linears(self)  # fp32 CPU decoding through oneDNN's packed weights (packing.py); training unchanged
        self.int8 = False  # decode_int8: CPU decoding through int8 weights

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        if isinstance(m, Injection):
            nn.init.zeros_(m.write.weight)

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target, method: str = "dspine", seed: int = 0, **overrides) -> DSpineDraftModel:
        """A fresh drafter sized for `target` (a dspine.target.Target), transfer space initialised."""
        from dspine.transfer import build_transfer_space

        info = target.info
        kw = dict(
            hidden_size=info.hidden_size,
            intermediate_size=int(getattr(target.model.config, "intermediate_size", 4 * info.hidden_size)),
            num_attention_heads=info.num_attention_heads,
            num_key_value_heads=info.num_key_value_heads,
            head_dim=info.head_dim,
            vocab_size=info.vocab_size,
            num_target_layers=info.num_layers,
            rms_norm_eps=info.rms_norm_eps,
            rope_theta=info.rope_theta,
            max_position_embeddings=info.max_position_embeddings,
            method=method,
        )
        kw["transfer_rank"] = min(256, info.hidden_size, info.vocab_size - 1)
        kw["message_size"] = kw["transfer_rank"]
        kw.update(overrides)
        cfg = DSpineConfig(**kw)
        torch.manual_seed(seed)
        model = cls(cfg)
        if cfg.uses_injection:
            ts = build_transfer_space(target.head_weight, cfg.transfer_rank)
            model.transfer_codes.copy_(ts.codes)
            for inj in model.injections.values():
                # rms(h) has norm sqrt(d) where the head's rows were normalised to 1
                inj.readout.weight.data.copy_(ts.proj / math.sqrt(cfg.hidden_size))
                inj.readout.bias.data.zero_()
        model.bind(target)
        return model

    def bind(self, target) -> DSpineDraftModel:
        """Borrow the target's (frozen) embedding and head; check the drafter was built for this target."""
        info = target.info
        if (info.vocab_size, info.hidden_size) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"drafter was built for vocab {self.config.vocab_size} / hidden {self.config.hidden_size}, "
                f"but target {target.name!r} has vocab {info.vocab_size} / hidden {info.hidden_size}"
            )
        if self.config.num_target_layers != info.num_layers:
            raise ValueError(
                f"drafter expects a target with {self.config.num_target_layers} layers, "
                f"target {target.name!r} has {info.num_layers}"
            )
        # in the drafter's dtype, converted once (a bf16 drafter beside an fp32 target reads half the bytes);
        # binding again to the same target in the same dtype (every Engine binds its drafter) keeps the copy
        dt = self.fc.weight.dtype
        src = target.embed.weight.data_ptr()
        if self._source == src and self._embed is not None and self._embed.dtype == dt:
            return self
        self._source = src
        self._embed = target.embed.weight.detach().to(dt)
        tied = target.head_weight is target.embed.weight
        self._head = self._embed if tied else target.head_weight.detach().to(dt)
        return self

    @property
    def head(self) -> torch.Tensor:
        if self._head is None:
            raise RuntimeError("drafter is not bound to a target: call drafter.bind(target)")
        return self._head

    # ---- pieces ----------------------------------------------------------------------------------------
    def context_kv(self, feats: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """feats (N, C, m*d) target-layer features, pos (N, C) -> per layer (k, v) each (N, Hkv, C, hd)."""
        c = self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))
        cs = rope_angles(pos, self.config.head_dim, self.config.rope_theta)
        return [layer.self_attn.kv(c, cs) for layer in self.layers]

    def decode_int8(self) -> DSpineDraftModel:
        """Decode on the CPU through int8 copies of the linears and of the candidate head (packing.py), the fp32
        weights kept for training and saving; the transition cache still reads the head's fp32 rows. `fc` stays
        fp32: its inputs, the target's raw hidden states, carry outlier channels that the per-tensor int8
        activations of a dynamic linear flatten (that alone cost most of τ, measured)."""
        for name, mod in self.named_children():
            if name != "fc":
                pack_linears(mod, int8=True)
        self.int8 = True
        return self

    @property
    def decode_dtype(self) -> torch.dtype:
        """What it decodes in, as checkpoint.draft_dtype names it (torch.qint8 for int8)."""
        return torch.qint8 if self.int8 else self.fc.weight.dtype

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., d) -> logits (..., V) through the drafter's final norm and the target head."""
        return linear(self.norm(h), self.head.to(h.dtype), int8=self.int8).float()

    def block_inputs(self, anchor: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """anchor (N, nb) token ids -> block token ids (N, nb, B): [anchor, mask, ..., mask]."""
        B = block_size or self.config.block_size
        ids = torch.full((*anchor.shape, B), self.config.mask_token_id, dtype=torch.long, device=anchor.device)
        ids[..., 0] = anchor
        return ids

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(
        self,
        block_ids: torch.Tensor,
        block_pos: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
    ) -> DraftOutput:
        """block_ids/block_pos (N, nb, B); ctx_kv per layer (N, Hkv, C, hd); mask (N, 1, nb*B, C+nb*B) or None."""
        if self._embed is None:
            raise RuntimeError("drafter is not bound to a target: call drafter.bind(target)")
        N, nb, B = block_ids.shape
        dtype = self.fc.weight.dtype
        h = F.embedding(block_ids, self._embed).to(dtype)  # (N, nb, B, d)
        cs = rope_angles(block_pos.reshape(N, nb * B), self.config.head_dim, self.config.rope_theta)
        if mask is None and self.config.is_causal:
            C = ctx_kv[0][0].shape[2]
            mask = block_attention_mask(torch.ones(N, nb, C, dtype=torch.bool, device=h.device), B, True)
        anchor_code = None
        if self.config.uses_injection:
            anchor_code = self.transfer_codes[block_ids[..., 0]].to(dtype)  # (N, nb, r)
            if not self.config.anchor_write:
                anchor_code = torch.zeros_like(anchor_code)
        feats, h_pre = {}, None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            k, v = ctx_kv[i]
            h = layer(h.reshape(N, nb * B, -1), cs, k, v, mask).reshape(N, nb, B, -1)
            if str(i) in self.injections:
                if i == last:
                    h_pre = h
                if kernels.enabled(h):
                    from dspine.kernels.injection import fused_injection

                    h, feats[i] = fused_injection(self.injections[str(i)], h, anchor_code)
                else:
                    h, feats[i] = self.injections[str(i)](h, anchor_code)
        return DraftOutput(hidden=h, h_pre=h_pre, feats=feats)


def block_attention_mask(ctx_visible: torch.Tensor, block_size: int, causal: bool) -> torch.Tensor:
    """ctx_visible (N, nb, C) bool -> mask (N, 1, nb*B, C + nb*B): each block sees its visible context and
    itself (all of itself, or slots <= its own when causal), never another block."""
    N, nb, C = ctx_visible.shape
    B = block_size
    dev = ctx_visible.device
    ctx = ctx_visible[:, :, None, :].expand(N, nb, B, C).reshape(N, nb * B, C)
    blk_id = torch.arange(nb * B, device=dev) // B
    same = blk_id[:, None] == blk_id[None, :]
    if causal:
        slot = torch.arange(nb * B, device=dev)
        same = same & (slot[None, :] <= slot[:, None])
    own = same[None].expand(N, nb * B, nb * B)
    return torch.cat([ctx, own], dim=-1)[:, None]
