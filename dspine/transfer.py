"""The unified transfer space: a fixed, whitened PCA code for every token, built from the target's head.

    Ŵ[v] = W_out[v] / ||W_out[v]||          row-normalised output embeddings       (V, d)
    μ    = mean_v Ŵ[v]                         centre
    Σ    = (Ŵ - μ)^T (Ŵ - μ) / V = U Λ U^T      PCA over the vocabulary
    T[v] = Λ_r^{-1/2} U_r^T (Ŵ[v] - μ)         top-r directions, whitened            (V, r)

A decoded token enters the drafter as T[v]; a still-forming prediction enters as a readout f = R h that
is trained (cosine) to point at T[y]. The projection P = Λ_r^{-1/2} U_r^T (r, d) and μ also initialise the
readouts. Computed in float64 so the whitening is exact to fp32 precision; each direction's sign is fixed
(largest entry positive), so a checkpoint need not store the codes: they are recomputed from the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TransferSpace:
    codes: torch.Tensor  # (V, r)  T
    proj: torch.Tensor  # (r, d)  Λ_r^{-1/2} U_r^T
    mean: torch.Tensor  # (d,)    μ


def build_transfer_space(head_weight: torch.Tensor, rank: int) -> TransferSpace:
    """head_weight (V, d) -> TransferSpace with codes (V, rank), whitened over the vocabulary."""
    V, d = head_weight.shape
    if not 1 <= rank <= min(d, V - 1):
        raise ValueError(f"transfer_rank={rank} must be in [1, min(hidden={d}, vocab-1={V - 1})]")
    w = head_weight.detach().to(torch.float64)
    w = w / w.norm(dim=1, keepdim=True).clamp_min(1e-12)
    mu = w.mean(dim=0)
    wc = w - mu
    cov = wc.T @ wc / V
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    evals, evecs = evals.flip(0)[:rank], evecs.flip(1)[:, :rank]
    # an eigenvector's sign is arbitrary (it differs between LAPACK builds and devices): fix it so the codes
    # recomputed at load time equal those a drafter was trained with — each direction's largest entry positive
    top = evecs.abs().argmax(dim=0)
    evecs = evecs * evecs[top, torch.arange(rank)].sign()
    if evals[-1] <= 1e-12:
        raise ValueError(f"transfer_rank={rank} exceeds the head's numerical rank")
    proj = evecs.T / evals.sqrt()[:, None]  # (r, d)
    codes = wc @ proj.T
    return TransferSpace(codes=codes.float(), proj=proj.float(), mean=mu.float())
