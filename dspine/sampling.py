"""Sampling parameters and the one warp (temperature, top-k, top-p) applied identically to the target's
distribution in AR decoding, to the target in verification, and to the drafter's proposal."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20


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
    presence_penalty: float = 0.0  # OpenAI's: subtracted from a token's logit once it appears in the output
    frequency_penalty: float = 0.0  # ... times the number of times it appears in the output
    logprobs: int | None = None  # None: off; k >= 0: each output token's log-probability and the top k

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
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


def penalize(logits: torch.Tensor, counts: torch.Tensor, drafts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """OpenAI's presence/frequency penalties at every row of a verify block: logits (W, V) at [anchor, drafts],
    counts (V,) of the output so far, drafts (W-1,) -> logits (W, V) where row j is penalized by the output
    followed by drafts[:j] — what AR decoding would have penalized had it produced those drafts."""
    W, V = logits.shape
    c = counts.expand(W, V).clone()
    if W > 1:
        c[1:] += torch.nn.functional.one_hot(drafts, V).to(c.dtype).cumsum(0)
    return logits - params.frequency_penalty * c - params.presence_penalty * (c > 0).to(c.dtype)


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
