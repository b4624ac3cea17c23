"""Sampling parameters and the one warp (temperature, top-k, top-p) applied identically to the target's
distribution in AR decoding, to the target in verification, and to the drafter's proposal."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, bad sampling parameters)."""


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V) after temperature, top-k and top-p (sampling only)."""
    x = logits.float() / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        sp, si = probs.sort(dim=-1, descending=True)
        before = sp.cumsum(-1) - sp  # mass strictly above each token
        drop = torch.zeros_like(sp, dtype=torch.bool).scatter(-1, si, before >= params.top_p)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs (..., V) -> token ids (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs (..., V), uniforms u (...) in [0, 1) -> the first index whose cumulative mass exceeds u·total
    (the sampler the fused walk kernel uses, given the same uniforms)."""
    cdf = probs.float().cumsum(-1)
    idx = (cdf <= u[..., None] * cdf[..., -1:]).sum(-1)
    return idx.clamp(max=probs.shape[-1] - 1)
