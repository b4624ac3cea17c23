"""Candidate head (Triton): the top-K of each draft slot's unconditioned logits without writing the logits.

Reference: `dspine.decoding.top_candidates` — logits = hidden · W_outᵀ over the whole vocabulary, then
`torch.topk`. On the H200 that top-K costs 0.035 ms more than DFlash's argmax at one block and 0.24 ms more
at 32 blocks (bench/results/kernels.json), the largest single part of DSpine's extra draft time at high
concurrency.

Two stages: (1) one program per (row tile, vocabulary tile of 128) computes its logits tile (fp32
accumulation) and extracts that tile's top-K by K rounds of max / argmax / mask, written to a small
scratch of V/128·K (value, id) pairs per row; row tiles vary fastest in the grid, so the programs sharing a
vocabulary tile of the head run together and read it from L2. (2) `torch.topk` over that scratch (6 % of the
vocabulary at K = 8), sorted descending as torch's is. Values are the fp32-accumulated logits (the reference
rounds them to the input dtype first), so bf16 near-ties may order differently; the set is the same up to
such ties.

Measured on the H200 (bench/results/kernels.json, bf16, graph replay, head + candidates per round at batch
1/4/16/32): K = 8 fused 0.056 / 0.066 / 0.157 / 0.250 ms vs torch 0.072 / 0.091 / 0.196 / 0.327; K = 32 fused
0.113 / 0.237 / 0.438 / 0.816 vs torch 0.070 / 0.090 / 0.195 / 0.328 (the K rounds of max grow with K; a
launch-config sweep found K = 16 at par or slower from batch 4). So DSPINE_CANDIDATES=auto (the default)
takes it for K <= 8 (at wide models only up to 64 rows) and `tiled_top_candidates` otherwise: cuBLAS logits,
then an exact top-K through tile maxima instead of torch.topk over the vocabulary; `fused` / `tiled` / `torch`
force one.
"""

from __future__ import annotations

import functools

import torch

from .injection import _pow2, interpreting, triton_cdiv

BLOCK_V = 128


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def tile_topk_kernel(
        X,
        W,
        VALS,
        IDS,
        n_rows,
        V,
        T,
        K: tl.constexpr,
        IN: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        pid_v = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        vv = tl.arange(0, BLOCK_V)
        cols = pid_v * BLOCK_V + vv
        dd = tl.arange(0, BLOCK_D)
        live, c_ok = rows < n_rows, cols < V
        wdt = tl.float32 if DOT_F32 else W.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
        for d0 in range(0, IN, BLOCK_D):
            d_ok = (d0 + dd) < IN
            x = tl.load(X + rows[:, None] * IN + d0 + dd[None, :], mask=live[:, None] & d_ok[None, :], other=0.0)
            w = tl.load(W + cols[None, :] * IN + d0 + dd[:, None], mask=c_ok[None, :] & d_ok[:, None], other=0.0)
            acc += tl.dot(x.to(wdt), w.to(wdt), input_precision=PREC)
        acc = tl.where(c_ok[None, :], acc, float("-inf"))
        kk = tl.arange(0, BLOCK_K)
        top_v = tl.full((BLOCK_M, BLOCK_K), float("-inf"), tl.float32)
        top_i = tl.zeros((BLOCK_M, BLOCK_K), tl.int32)
        for k in tl.static_range(K):
            m = tl.max(acc, axis=1)
            i = tl.argmax(acc, axis=1)  # the first column holding the max
            top_v = tl.where(kk[None, :] == k, m[:, None], top_v)
            top_i = tl.where(kk[None, :] == k, (pid_v * BLOCK_V + i)[:, None], top_i)
            acc = tl.where(vv[None, :] == i[:, None], float("-inf"), acc)
        out = (rows[:, None] * T + pid_v) * K + kk[None, :]
        keep = live[:, None] & (kk < K)[None, :]
        tl.store(VALS + out, top_v, mask=keep)
        tl.store(IDS + out, top_i, mask=keep)

    return tile_topk_kernel


def fused_top_candidates(hidden: torch.Tensor, head: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as dspine.decoding.top_candidates: hidden (N, d), head (V, d) -> ids (N, K) int64,
    values (N, K) fp32, best first."""
    N, D = hidden.shape
    V = head.shape[0]
    K = min(int(k), V)
    T = triton_cdiv(V, BLOCK_V)
    vals = torch.empty(N, T, K, device=hidden.device, dtype=torch.float32)
    ids = torch.empty(N, T, K, device=hidden.device, dtype=torch.int32)
    if N:
        BM = min(64, _pow2(N))
        f32 = hidden.dtype == torch.float32
        _kernel()[(triton_cdiv(N, BM), T)](
            hidden.contiguous(),
            head,
            vals,
            ids,
            N,
            V,
            T,
            K=K,
            IN=D,
            BLOCK_M=BM,
            BLOCK_V=BLOCK_V,
            BLOCK_D=64,
            BLOCK_K=_pow2(K, lo=2),
            PREC="ieee" if f32 else "tf32",
            DOT_F32=f32 or interpreting(),
        )
    best, j = vals.view(N, T * K).topk(K, dim=-1)
    return ids.view(N, T * K).gather(1, j).long(), best


def tiled_top_candidates(
    hidden: torch.Tensor, head: torch.Tensor, k: int, tile: int = BLOCK_V
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as fused_top_candidates, for many rows at wide models: cuBLAS writes the (N, V) logits, as
    for DFlash's argmax, then an exact top-K without torch.topk over V. The K tiles of `tile` logits with the
    largest maxima hold the K best (a logit in any other tile is below K tile maxima, each a different logit),
    so topk runs over the N × V/tile maxima and then over those K tiles (N × K·tile). Plain torch ops."""
    logits = torch.matmul(hidden, head.t().to(hidden.dtype))  # (N, V)
    N, V = logits.shape
    K = min(int(k), V)
    T = -(-V // tile)
    if T <= K:
        vals, ids = logits.topk(K, dim=-1)
        return ids, vals.float()
    if V % tile:
        logits = torch.nn.functional.pad(logits, (0, T * tile - V), value=float("-inf"))
    x = logits.view(N, T, tile)
    tiles = x.amax(-1).topk(K, dim=-1).indices  # (N, K)
    vals, j = x.gather(1, tiles[..., None].expand(N, K, tile)).view(N, K * tile).topk(K, dim=-1)
    return tiles.gather(1, j // tile) * tile + j % tile, vals.float()


FUSED_MAX_K = 8  # auto: the widest K measured faster than torch's matmul + topk at every batch
WIDE_MAX_ROWS = 64  # auto, above kernels.fused_max_width(): the most rows (4 blocks of 16) it was measured faster at
CHOICES = ("auto", "fused", "tiled", "torch")


def choice(k: int, rows: int = 0, width: int = 0) -> str:
    """How the candidate sets of width k for `rows` hidden states of `width` are formed where kernels.enabled
    holds: "fused" (tile_topk_kernel), "tiled" (cuBLAS logits + tiled_top_candidates) or "torch" (logits +
    torch.topk). DSPINE_CANDIDATES=auto (default): fused for k <= FUSED_MAX_K, and at wide models (above
    kernels.fused_max_width(), where cuBLAS writes the logits faster than 16-wide tiles walk d) only up to
    WIDE_MAX_ROWS rows (bench/results/kernels_qwen3-8b.json); tiled otherwise."""
    from . import fused_max_width, setting

    mode = setting("DSPINE_CANDIDATES", CHOICES, "auto")
    if mode != "auto":
        return mode
    fused = int(k) <= FUSED_MAX_K and (width <= fused_max_width() or rows <= WIDE_MAX_ROWS)
    return "fused" if fused else "tiled"
