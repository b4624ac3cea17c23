"""Transition cache + walk (Triton): the K×K scores of the redone last write, then the greedy or sampled
left-to-right walk with the proposal probabilities out.

References (dspine.decoding): `transition_scores` — for slot t >= 2 and each predecessor candidate a,
h'_{t|a} = h_pre_t + W(σ(A f_t + b + P T[a]) ⊙ M T[a]), S_t[a, b] = <W_out[b], norm(h'_{t|a})>;
`walk_greedy`; `walk_sample` given uniforms (temperature, top-k, top-p over the K candidates, inverse-CDF).

Scores: one program per (row, slot); the K predecessors are the M side of the dots (padded to 16); gate ⊙
message is built in 16-wide chunks of the message dimension into scratch rows only this program touches;
the RMS scale is applied to the finished dot products (norm is a per-row scalar times a weight). Walks: one
program per row, B-2 dependent steps over K values each — a table lookup, as the method intends.

Wide models (above kernels.fused_max_width(), where a 16-wide tile walking d loses to cuBLAS): `lowrank_
transition_scores`, plain torch, never forms the K redone d-wide states of a slot. With x = h_pre_t, m_a =
σ(A f_t + b + P T[a]) ⊙ M T[a] and γ the norm's weight,
    S_t[a, b] = (<W_out[b] ⊙ γ, x> + ((W_out[b] ⊙ γ)ᵀ W) m_a) · rms(x + W m_a)⁻¹,
    |x + W m_a|² = |x|² + 2 (Wᵀx)·m_a + m_aᵀ (WᵀW) m_a,
so the d-wide work is the gather of the successors' head rows and one product of them with γ ⊙ W (d × s);
everything per predecessor is s-wide. It replaces the eager scores from LOWRANK_MIN_BLOCKS blocks on (`lowrank_wanted`).
"""

from __future__ import annotations

import functools

import torch

from .injection import _pow2, interpreting


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def scores_kernel(
        HPRE,
        F,
        CAND,
        CODES,
        HEAD,
        NORMW,
        WA,
        BA,
        WP,
        WM,
        WW,
        G,
        OUT,
        B,
        K,
        eps,
        D: tl.constexpr,
        R: tl.constexpr,
        S: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_S: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        n = tl.program_id(0)
        j = tl.program_id(1)  # slot t = j + 2; predecessor candidates cand[n, j], successors cand[n, j + 1]
        t = j + 2
        kk = tl.arange(0, BLOCK_K)
        rr = tl.arange(0, BLOCK_R)
        sc = tl.arange(0, BLOCK_S)
        dd = tl.arange(0, BLOCK_D)
        k_ok = kk < K
        r_ok = rr < R
        wdt = tl.float32 if DOT_F32 else WW.dtype.element_ty
        a = tl.load(CAND + (n * (B - 1) + j) * K + kk, mask=k_ok, other=0)
        b = tl.load(CAND + (n * (B - 1) + j + 1) * K + kk, mask=k_ok, other=0)
        code = tl.load(CODES + a[:, None] * R + rr[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0).to(wdt)
        f = tl.load(F + (n * B + t) * R + rr, mask=r_ok, other=0.0).to(tl.float32)
        gbase = G + (n * (B - 2) + j) * BLOCK_K * S
        # gate ⊙ message of every predecessor candidate, S in chunks, parked in this program's scratch
        for s0 in range(0, S, BLOCK_S):
            s_ok = (s0 + sc) < S
            w_mask = r_ok[:, None] & s_ok[None, :]
            wa = tl.load(WA + (s0 + sc)[None, :] * R + rr[:, None], mask=w_mask, other=0.0).to(tl.float32)
            wp = tl.load(WP + (s0 + sc)[None, :] * R + rr[:, None], mask=w_mask, other=0.0).to(wdt)
            wm = tl.load(WM + (s0 + sc)[None, :] * R + rr[:, None], mask=w_mask, other=0.0).to(wdt)
            ga = tl.sum(f[:, None] * wa, axis=0) + tl.load(BA + s0 + sc, mask=s_ok, other=0.0).to(tl.float32)
            g = tl.sigmoid(ga[None, :] + tl.dot(code, wp, input_precision=PREC)) * tl.dot(
                code, wm, input_precision=PREC
            )
            tl.store(gbase + kk[:, None] * S + s0 + sc[None, :], g, mask=s_ok[None, :])
        tl.debug_barrier()
        acc = tl.zeros((BLOCK_K, BLOCK_K), tl.float32)
        sq = tl.zeros((BLOCK_K,), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d_ok = (d0 + dd) < D
            w = tl.zeros((BLOCK_K, BLOCK_D), tl.float32)
            for s0 in range(0, S, BLOCK_S):
                s_ok = (s0 + sc) < S
                g = tl.load(gbase + kk[:, None] * S + s0 + sc[None, :], mask=s_ok[None, :], other=0.0).to(wdt)
                ww = tl.load(
                    WW + (d0 + dd)[None, :] * S + s0 + sc[:, None], mask=s_ok[:, None] & d_ok[None, :], other=0.0
                ).to(wdt)
                w += tl.dot(g, ww, input_precision=PREC)
            hp = tl.load(HPRE + (n * B + t) * D + d0 + dd, mask=d_ok, other=0.0).to(tl.float32)
            h = hp[None, :] + w  # (BLOCK_K, BLOCK_D): the redone hidden of each predecessor candidate
            sq += tl.sum(h * h, axis=1)
            nw = tl.load(NORMW + d0 + dd, mask=d_ok, other=0.0).to(tl.float32)
            succ = tl.load(
                HEAD + b[None, :] * D + (d0 + dd)[:, None], mask=d_ok[:, None] & k_ok[None, :], other=0.0
            ).to(wdt)  # (BLOCK_D, BLOCK_K)
            acc += tl.dot((h * nw[None, :]).to(wdt), succ, input_precision=PREC)
        acc = acc * tl.rsqrt(sq / D + eps)[:, None]
        o = ((n * (B - 2) + j) * K + kk[:, None]) * K + kk[None, :]
        tl.store(OUT + o, acc, mask=k_ok[:, None] & k_ok[None, :])

    @triton.jit
    def walk_kernel(
        CAND,
        SC,
        FIRST,
        U,
        TOK,
        Q,
        K,
        temperature,
        top_k,
        top_p,
        B: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SAMPLE: tl.constexpr,
    ):
        n = tl.program_id(0)
        kk = tl.arange(0, BLOCK_K)
        k_ok = kk < K
        if SAMPLE:
            idx = tl.load(FIRST + n).to(tl.int32)
        else:
            idx = tl.full([], 0, tl.int32)
            tl.store(TOK + n * (B - 1), tl.load(CAND + n * (B - 1) * K))
        for j in range(0, B - 2):
            row = tl.load(SC + ((n * (B - 2) + j) * K + idx) * K + kk, mask=k_ok, other=float("-inf"))
            if SAMPLE:
                x = row / temperature
                x2 = tl.where(k_ok, x, float("-inf"))
                # top-k: keep a candidate when fewer than top_k others are strictly larger
                above = tl.sum((x2[None, :] > x2[:, None]).to(tl.int32), axis=1)
                keep = k_ok & ((top_k <= 0) | (above < top_k))
                x3 = tl.where(keep, x2, float("-inf"))
                e = tl.where(keep, tl.exp(x3 - tl.max(x3, axis=0)), 0.0)
                p = e / tl.sum(e, axis=0)
                # top-p: drop a candidate when the mass ranked strictly above it already reaches top_p
                ahead = (p[None, :] > p[:, None]) | ((p[None, :] == p[:, None]) & (kk[None, :] < kk[:, None]))
                before = tl.sum(tl.where(ahead, p[None, :], 0.0), axis=1)
                p = tl.where(keep & ((top_p >= 1.0) | (before < top_p)), p, 0.0)
                p = p / tl.sum(p, axis=0)
                tl.store(Q + (n * (B - 2) + j) * K + kk, p, mask=k_ok)
                cdf = tl.cumsum(p, axis=0)
                u = tl.load(U + n * (B - 2) + j)
                idx = tl.minimum(tl.sum(((cdf <= u * tl.sum(p, axis=0)) & k_ok).to(tl.int32), axis=0), K - 1)
                tl.store(TOK + n * (B - 2) + j, tl.load(CAND + (n * (B - 1) + j + 1) * K + idx))
            else:
                idx = tl.argmax(row, axis=0).to(tl.int32)
                tl.store(TOK + n * (B - 1) + j + 1, tl.load(CAND + (n * (B - 1) + j + 1) * K + idx))

    return scores_kernel, walk_kernel


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def fused_transition_scores(
    inj, norm, head: torch.Tensor, codes: torch.Tensor, h_pre: torch.Tensor, f: torch.Tensor, cand: torch.Tensor
) -> torch.Tensor:
    """Same contract as dspine.decoding.transition_scores: h_pre (N, B, d), f (N, B, r), cand (N, B-1, K)
    -> S (N, B-2, K, K) fp32."""
    N, B, D = h_pre.shape
    K = cand.shape[-1]
    R, S = inj.readout.out_features, inj.message.out_features
    out = torch.empty(N, max(B - 2, 0), K, K, device=h_pre.device, dtype=torch.float32)
    if B <= 2:
        return out
    scores, _ = _kernels()
    BK = _pow2(K)
    g = torch.empty(N, B - 2, BK, S, device=h_pre.device, dtype=torch.float32)  # per-program scratch
    scores[(N, B - 2)](
        h_pre.contiguous(),
        f.contiguous(),
        cand.contiguous(),
        codes,
        head,
        norm.weight,
        inj.gate_f.weight,
        inj.gate_f.bias,
        inj.gate_p.weight,
        inj.message.weight,
        inj.write.weight,
        g,
        out,
        B,
        K,
        float(norm.eps),
        D=D,
        R=R,
        S=S,
        BLOCK_K=BK,
        BLOCK_D=32,
        BLOCK_R=_pow2(R),
        BLOCK_S=16,
        PREC=_prec(h_pre.dtype),
        DOT_F32=h_pre.dtype == torch.float32 or interpreting(),
        num_stages=2,
    )
    return out


def lowrank_transition_scores(
    inj, norm, head: torch.Tensor, codes: torch.Tensor, h_pre: torch.Tensor, f: torch.Tensor, cand: torch.Tensor
) -> torch.Tensor:
    """Same contract as dspine.decoding.transition_scores: h_pre (N, B, d), f (N, B, r), cand (N, B-1, K)
    -> S (N, B-2, K, K) fp32; the s-wide form of the module docstring (torch ops, any device)."""
    N, B, D = h_pre.shape
    if B <= 2:
        return torch.zeros(N, 0, cand.shape[-1], cand.shape[-1], device=h_pre.device)
    dt = h_pre.dtype
    x = h_pre[:, 2:]  # (N, B-2, d)
    pred = codes[cand[:, :-1]].to(dt)  # (N, B-2, K, r)
    m = (torch.sigmoid(inj.gate_f(f[:, 2:, None, :]) + inj.gate_p(pred)) * inj.message(pred)).float()  # (.., K, s)
    W = inj.write.weight.float()  # (d, s)
    gamma = norm.weight.float()
    succ = head[cand[:, 1:]].to(dt)  # (N, B-2, K, d)
    xf = x.float()
    along = torch.matmul(succ, (xf * gamma).to(dt)[..., None]).squeeze(-1).float()  # <W_out[b] ⊙ γ, x>
    across = torch.matmul(succ, (gamma[:, None] * W).to(dt)).float()  # (N, B-2, K, s): (W_out[b] ⊙ γ)ᵀ W
    num = along[..., None, :] + torch.matmul(m, across.transpose(-1, -2))  # (N, B-2, K_a, K_b)
    u = torch.matmul(xf, W)  # (N, B-2, s): Wᵀ x
    sq = xf.pow(2).sum(-1, keepdim=True) + 2 * (m * u[..., None, :]).sum(-1)
    sq = sq + (torch.matmul(m, W.t() @ W) * m).sum(-1)  # (N, B-2, K_a): |x + W m_a|²
    return num * torch.rsqrt(sq.clamp_min(0) / D + norm.eps)[..., None]


LOWRANK_MIN_BLOCKS = 32  # auto: where the s-wide form beat the eager scores at 8B width (bench/kernels.py)


def lowrank_wanted(blocks: int) -> bool:
    """Whether the eager scores' place goes to lowrank_transition_scores for `blocks` blocks: DSPINE_TRANSITION=
    auto (default) from LOWRANK_MIN_BLOCKS on (below, its ~30 small launches cost more than the d-wide passes
    they save), `lowrank` always, `eager` never."""
    from . import setting

    mode = setting("DSPINE_TRANSITION", ("auto", "lowrank", "eager"), "auto")
    return mode == "lowrank" or (mode == "auto" and blocks >= LOWRANK_MIN_BLOCKS)


def fused_walk_greedy(cand: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """Same contract as dspine.decoding.walk_greedy: cand (N, B-1, K), S (N, B-2, K, K) -> tokens (N, B-1)."""
    N, Bm1, K = cand.shape
    tok = torch.empty(N, Bm1, dtype=cand.dtype, device=cand.device)
    _, walk = _kernels()
    dummy = S.new_empty(1)
    walk[(N,)](
        cand.contiguous(),
        S.contiguous(),
        cand,
        dummy,
        tok,
        dummy,
        K,
        1.0,
        0,
        1.0,
        B=Bm1 + 1,
        BLOCK_K=_pow2(K),
        SAMPLE=False,
    )
    return tok


def fused_walk_sample(
    cand: torch.Tensor, S: torch.Tensor, first_idx: torch.Tensor, params, vocab: int, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as dspine.decoding.walk_sample with `uniforms` (N, B-2): tokens (N, B-2), q (N, B-2, V)."""
    N, Bm1, K = cand.shape
    tok = torch.empty(N, max(Bm1 - 1, 0), dtype=cand.dtype, device=cand.device)
    qk = torch.zeros(N, max(Bm1 - 1, 0), K, dtype=torch.float32, device=cand.device)
    if Bm1 > 1:
        _, walk = _kernels()
        walk[(N,)](
            cand.contiguous(),
            S.contiguous(),
            first_idx.contiguous(),
            uniforms.float().contiguous(),
            tok,
            qk,
            K,
            float(params.temperature),
            int(params.top_k),
            float(params.top_p),
            B=Bm1 + 1,
            BLOCK_K=_pow2(K),
            SAMPLE=True,
        )
    q = torch.zeros(N, max(Bm1 - 1, 0), vocab, device=cand.device).scatter_(2, cand[:, 1:], qk)
    return tok, q
