"""Fused adjacent injection for one drafter layer (Triton).

Reference: `dspine.drafter.Injection.forward` — readout f = R·rms(h) + b_R of every slot, predecessor
p_t = f_{t-1} (slot 1: the anchor's code T[x_0]), gate σ(A f_t + b + P p_t), message M p_t, write-back
h_t += W (gate ⊙ message) for slots t >= 1, all slots in parallel from the pre-update features.

One program owns BLOCK_M consecutive (row, slot) pairs. It computes the readouts of its own slots and of
their predecessors (the slot one row up: "both features"), so no grid-wide sync is needed; the RMS scale
is applied after the readout product (R·(h·s) = s·(R·h)). The message dimension is walked in 16-wide
chunks (weight tiles small enough for shared memory at r = s = 256) and gate ⊙ message is parked in
global scratch rows that only this program touches, then read back for the write-back. Dots run in the
weights' dtype with fp32 accumulation; fp32 uses IEEE dots (parity with the reference).

Three layouts, chosen by `variant` (default: DSPINE_INJECTION, else by width: "split" up to
kernels.fused_max_width(), "gemm" above):
- "rows": the single kernel above; one program per 16 rows, so at batch 1 (16 rows) one SM streams all of
  the layer's weights (~1 MB in bf16).
- "split": three launches whose grids also tile the output dimension — readout (rows × r-tiles), gate ⊙
  message (rows × s-tiles, predecessors read from the stored readouts) and write-back (rows × d-tiles; the
  readout and write-back share one row-tiled linear kernel) — so every weight tile is read by one program
  and the layer spreads over 68 programs at batch 1 (16-wide tiles).
- "gemm": for wide models (4096 at 8B), where a 16-wide tile walking d serially is slow: the two d-wide
  products go to cuBLAS — the raw readout h·R^T and the write-back h + (gate ⊙ message)·W^T as one addmm —
  with |h|² from `add_sumsq` (one row kernel, which also adds SGLang's residual into the stream); the message
  kernel of "split" forms f = h·R^T·rms^-1 + b_R itself. Four launches a layer instead of the eager path's
  dozen.
Their timings beside the eager reference: bench/kernels.py (bench/results/kernels*.json).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def injection_kernel(
        H,
        OUT,
        F,
        MSG,
        ANC,
        WR,
        BR,
        WA,
        BA,
        WP,
        WM,
        WW,
        n_rows,
        B,
        eps,
        D: tl.constexpr,
        R: tl.constexpr,
        S: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_S: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        live = rows < n_rows
        slot = rows % B
        blk = rows // B
        prev_live = live & (slot >= 2)
        rr = tl.arange(0, BLOCK_R)
        sc = tl.arange(0, BLOCK_S)
        dd = tl.arange(0, BLOCK_D)
        r_ok = rr < R
        wdt = tl.float32 if DOT_F32 else WR.dtype.element_ty
        # 1. readouts of the own and the predecessor slots (unnormalised) and their sums of squares
        f_own = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
        f_prev = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
        sq_own = tl.zeros((BLOCK_M,), tl.float32)
        sq_prev = tl.zeros((BLOCK_M,), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d_ok = (d0 + dd) < D
            x = tl.load(H + rows[:, None] * D + d0 + dd[None, :], mask=live[:, None] & d_ok[None, :], other=0.0)
            xp = tl.load(
                H + (rows - 1)[:, None] * D + d0 + dd[None, :], mask=prev_live[:, None] & d_ok[None, :], other=0.0
            )
            wr = tl.load(WR + rr[None, :] * D + d0 + dd[:, None], mask=r_ok[None, :] & d_ok[:, None], other=0.0).to(wdt)
            f_own += tl.dot(x.to(wdt), wr, input_precision=PREC)
            f_prev += tl.dot(xp.to(wdt), wr, input_precision=PREC)
            sq_own += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
            sq_prev += tl.sum(xp.to(tl.float32) * xp.to(tl.float32), axis=1)
        br = tl.load(BR + rr, mask=r_ok, other=0.0).to(tl.float32)
        f_own = f_own * tl.rsqrt(sq_own / D + eps)[:, None] + br[None, :]
        f_prev = f_prev * tl.rsqrt(sq_prev / D + eps)[:, None] + br[None, :]
        anc = tl.load(
            ANC + blk[:, None] * R + rr[None, :], mask=(live & (slot == 1))[:, None] & r_ok[None, :], other=0.0
        ).to(tl.float32)
        p = tl.where((slot == 1)[:, None], anc, f_prev).to(wdt)
        tl.store(F + rows[:, None] * R + rr[None, :], f_own.to(F.dtype.element_ty), mask=live[:, None] & r_ok[None, :])
        fo = f_own.to(wdt)
        # 2. gate ⊙ message, S in chunks (keeps the weight tiles small), parked in this program's scratch rows
        for s0 in range(0, S, BLOCK_S):
            s_ok = (s0 + sc) < S
            w_mask = r_ok[:, None] & s_ok[None, :]
            wa = tl.load(WA + (s0 + sc)[None, :] * R + rr[:, None], mask=w_mask, other=0.0).to(wdt)
            wp = tl.load(WP + (s0 + sc)[None, :] * R + rr[:, None], mask=w_mask, other=0.0).to(wdt)
            wm = tl.load(WM + (s0 + sc)[None, :] * R + rr[:, None], mask=w_mask, other=0.0).to(wdt)
            ba = tl.load(BA + s0 + sc, mask=s_ok, other=0.0).to(tl.float32)
            g = tl.dot(fo, wa, input_precision=PREC) + tl.dot(p, wp, input_precision=PREC) + ba[None, :]
            m = tl.sigmoid(g) * tl.dot(p, wm, input_precision=PREC)
            tl.store(MSG + rows[:, None] * S + s0 + sc[None, :], m, mask=live[:, None] & s_ok[None, :])
        tl.debug_barrier()
        # 3. write-back h += W (gate ⊙ message) for slots >= 1
        writes = live & (slot >= 1)
        for d0 in range(0, D, BLOCK_D):
            d_ok = (d0 + dd) < D
            acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            for s0 in range(0, S, BLOCK_S):
                s_ok = (s0 + sc) < S
                m = tl.load(MSG + rows[:, None] * S + s0 + sc[None, :], mask=live[:, None] & s_ok[None, :], other=0.0)
                ww = tl.load(
                    WW + (d0 + dd)[None, :] * S + s0 + sc[:, None], mask=s_ok[:, None] & d_ok[None, :], other=0.0
                ).to(wdt)
                acc += tl.dot(m.to(wdt), ww, input_precision=PREC)
            x = tl.load(H + rows[:, None] * D + d0 + dd[None, :], mask=live[:, None] & d_ok[None, :], other=0.0)
            y = x.to(tl.float32) + tl.where(writes[:, None], acc, 0.0)
            tl.store(
                OUT + rows[:, None] * D + d0 + dd[None, :],
                y.to(OUT.dtype.element_ty),
                mask=live[:, None] & d_ok[None, :],
            )

    return injection_kernel


@functools.cache
def _split_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rows_linear_kernel(
        X,
        W,
        BIAS,
        RES,
        OUT,
        n_rows,
        B,
        eps,
        IN: tl.constexpr,
        N: tl.constexpr,
        READOUT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        # OUT[rows, n-tile] = X W^T, then READOUT: × rms(X)^-1 + bias (f = R·rms(h) + b), else the write-back:
        # RES + (slot >= 1) · X W^T (h += W (gate ⊙ message))
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        live, n_ok = rows < n_rows, nn < N
        wdt = tl.float32 if DOT_F32 else W.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        sq = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            k_ok = (k0 + kk) < IN
            x = tl.load(X + rows[:, None] * IN + k0 + kk[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + nn[None, :] * IN + k0 + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0).to(wdt)
            acc += tl.dot(x.to(wdt), w, input_precision=PREC)
            if READOUT:
                sq += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
        out_mask = live[:, None] & n_ok[None, :]
        if READOUT:
            y = (
                acc * tl.rsqrt(sq / IN + eps)[:, None]
                + tl.load(BIAS + nn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            )
        else:
            res = tl.load(RES + rows[:, None] * N + nn[None, :], mask=out_mask, other=0.0).to(tl.float32)
            y = res + tl.where((live & (rows % B >= 1))[:, None], acc, 0.0)
        tl.store(OUT + rows[:, None] * N + nn[None, :], y.to(OUT.dtype.element_ty), mask=out_mask)

    @triton.jit
    def message_kernel(
        F,
        ANC,
        MSG,
        WA,
        BA,
        WP,
        WM,
        SQ,
        BR,
        FOUT,
        n_rows,
        B,
        eps,
        IN,
        R: tl.constexpr,
        S: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_S: tl.constexpr,
        FROM_RAW: tl.constexpr,
        PREC: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        # MSG[rows, s-tile] = σ(A f_t + b + P p_t) ⊙ M p_t (0 on anchor slots: p = 0 there). FROM_RAW: F holds
        # the unnormalised readout h·R^T and SQ the rows' |h|²; f = F·rms^-1 + b_R is formed here (and stored to
        # FOUT by the programs of the first s-tile)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        ss = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        rr = tl.arange(0, BLOCK_R)
        live, s_ok = rows < n_rows, ss < S
        slot = rows % B
        prev = live & (slot >= 2)
        wdt = tl.float32 if DOT_F32 else WA.dtype.element_ty
        if FROM_RAW:
            rs_own = tl.rsqrt(tl.load(SQ + rows, mask=live, other=0.0) / IN + eps)
            rs_prev = tl.rsqrt(tl.load(SQ + rows - 1, mask=prev, other=0.0) / IN + eps)
        g = tl.zeros((BLOCK_M, BLOCK_S), tl.float32)
        m = tl.zeros((BLOCK_M, BLOCK_S), tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r_ok = (r0 + rr) < R
            fo = tl.load(F + rows[:, None] * R + r0 + rr[None, :], mask=live[:, None] & r_ok[None, :], other=0.0)
            fp = tl.load(
                F + (rows - 1)[:, None] * R + r0 + rr[None, :],
                mask=prev[:, None] & r_ok[None, :],
                other=0.0,
            )
            if FROM_RAW:
                br = tl.load(BR + r0 + rr, mask=r_ok, other=0.0).to(tl.float32)[None, :]
                fo = (fo.to(tl.float32) * rs_own[:, None] + br).to(FOUT.dtype.element_ty)
                fp = tl.where(prev[:, None], fp.to(tl.float32) * rs_prev[:, None] + br, 0.0).to(FOUT.dtype.element_ty)
                if tl.program_id(1) == 0:
                    tl.store(FOUT + rows[:, None] * R + r0 + rr[None, :], fo, mask=live[:, None] & r_ok[None, :])
            an = tl.load(
                ANC + (rows // B)[:, None] * R + r0 + rr[None, :],
                mask=(live & (slot == 1))[:, None] & r_ok[None, :],
                other=0.0,
            )
            p = tl.where((slot == 1)[:, None], an.to(tl.float32), fp.to(tl.float32)).to(wdt)
            w_mask = r_ok[:, None] & s_ok[None, :]
            wa = tl.load(WA + ss[None, :] * R + r0 + rr[:, None], mask=w_mask, other=0.0).to(wdt)
            wp = tl.load(WP + ss[None, :] * R + r0 + rr[:, None], mask=w_mask, other=0.0).to(wdt)
            wm = tl.load(WM + ss[None, :] * R + r0 + rr[:, None], mask=w_mask, other=0.0).to(wdt)
            g += tl.dot(fo.to(wdt), wa, input_precision=PREC) + tl.dot(p, wp, input_precision=PREC)
            m += tl.dot(p, wm, input_precision=PREC)
        g += tl.load(BA + ss, mask=s_ok, other=0.0).to(tl.float32)[None, :]
        msg = (tl.sigmoid(g) * m).to(MSG.dtype.element_ty)
        tl.store(MSG + rows[:, None] * S + ss[None, :], msg, mask=live[:, None] & s_ok[None, :])

    return rows_linear_kernel, message_kernel


VARIANTS = ("rows", "split", "gemm")


def injection_variant(variant: str | None = None, width: int = 0) -> str:
    """`variant`, else DSPINE_INJECTION, else by the model width: "split" up to kernels.fused_max_width(),
    "gemm" above it (cuBLAS then streams the d-wide weights faster than 16-wide Triton tiles)."""
    from . import fused_max_width, setting

    return setting("DSPINE_INJECTION", VARIANTS, "split" if width <= fused_max_width() else "gemm", variant)


def interpreting() -> bool:
    """Under TRITON_INTERPRET=1 dots run in fp32 (the interpreter's bf16 dots are not faithful)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (int(n) - 1).bit_length())


def fused_injection(
    inj, h: torch.Tensor, anchor_code: torch.Tensor, variant: str | None = None, sumsq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as Injection.forward: h (N, nb, B, d), anchor_code (N, nb, r) -> (h updated, f (N, nb, B, r)).
    `sumsq` (N*nb*B,) fp32: the rows' |h|² where the caller already has them (add_sumsq; "gemm" reads them)."""
    N, nb, B, D = h.shape
    R, S = inj.readout.out_features, inj.message.out_features
    h = h.contiguous()
    out = torch.empty_like(h)
    f = torch.empty(N, nb, B, R, device=h.device, dtype=h.dtype)
    n_rows = N * nb * B
    anc = anchor_code.to(h.dtype).contiguous()
    eps = float(torch.finfo(h.dtype).eps)
    prec = dict(PREC="ieee" if h.dtype == torch.float32 else "tf32", DOT_F32=h.dtype == torch.float32 or interpreting())
    variant = injection_variant(variant, D)
    BM, BN = 16, 16  # the smallest dot tiles: most programs at batch 1, where latency rules
    rows = triton_cdiv(n_rows, BM)
    if variant == "gemm":
        h2 = h.view(n_rows, D)
        raw = torch.mm(h2, inj.readout.weight.t())  # (n_rows, r) h·R^T, normalised in the message kernel
        sq = add_sumsq(h2)[1] if sumsq is None else sumsq  # (n_rows,) fp32 |h|²
        msg = torch.empty(n_rows, S, device=h.device, dtype=h.dtype)
        _gate_message(inj, raw, anc, msg, B, eps, D, prec, sumsq=sq, f=f)
        # anchor rows of msg are 0, so they keep h exactly
        torch.addmm(h2, msg, inj.write.weight.t(), out=out.view(n_rows, D))
        return out, f
    msg = torch.empty(n_rows, S, device=h.device, dtype=torch.float32)  # gate ⊙ message, fp32
    if variant == "split":
        linear, _ = _split_kernels()
        linear[(rows, triton_cdiv(R, BN))](
            h,
            inj.readout.weight,
            inj.readout.bias,
            h,
            f,
            n_rows,
            B,
            eps,
            IN=D,
            N=R,
            READOUT=True,
            BLOCK_M=BM,
            BLOCK_N=BN,
            BLOCK_K=64,
            **prec,
        )
        _gate_message(inj, f, anc, msg, B, eps, D, prec)
        linear[(rows, triton_cdiv(D, BN))](
            msg,
            inj.write.weight,
            inj.write.weight,
            h,
            out,
            n_rows,
            B,
            eps,
            IN=S,
            N=D,
            READOUT=False,
            BLOCK_M=BM,
            BLOCK_N=BN,
            BLOCK_K=32,
            **prec,
        )
        return out, f
    BLOCK_M = 16
    _kernel()[(triton_cdiv(n_rows, BLOCK_M),)](
        h,
        out,
        f,
        msg,
        anc,
        inj.readout.weight,
        inj.readout.bias,
        inj.gate_f.weight,
        inj.gate_f.bias,
        inj.gate_p.weight,
        inj.message.weight,
        inj.write.weight,
        n_rows,
        B,
        eps,
        D=D,
        R=R,
        S=S,
        BLOCK_M=BLOCK_M,
        BLOCK_D=32,
        BLOCK_R=_pow2(R),
        BLOCK_S=16,
        num_stages=2,
        **prec,
    )
    return out, f


def _gate_message(inj, src, anc, msg, B: int, eps: float, D: int, prec: dict, sumsq=None, f=None) -> None:
    """msg (n_rows, s) = gate ⊙ message of every row (0 on anchor slots), from the readouts src (n_rows, r); with
    `sumsq` (n_rows,) = |h|², src holds the raw h·R^T instead and the readouts formed on the way go to f."""
    _, message = _split_kernels()
    R, S = inj.readout.out_features, inj.message.out_features
    n_rows = src.numel() // R
    raw = sumsq is not None
    message[(triton_cdiv(n_rows, 16), triton_cdiv(S, 16))](
        src,
        anc,
        msg,
        inj.gate_f.weight,
        inj.gate_f.bias,
        inj.gate_p.weight,
        inj.message.weight,
        sumsq if raw else msg,
        inj.readout.bias,
        f if raw else msg,
        n_rows,
        B,
        eps,
        D,
        R=R,
        S=S,
        BLOCK_M=16,
        BLOCK_R=32,
        BLOCK_S=16,
        FROM_RAW=raw,
        **prec,
    )


@functools.cache
def _sumsq_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def add_sumsq_kernel(H, RES, X, SQ, D: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row: X = H + RES (rounded to the stream's dtype, as torch's add), SQ = |X|² in fp32
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), tl.float32)
        for d0 in range(0, D, BLOCK):
            ok = d0 + cols < D
            x = tl.load(H + row * D + d0 + cols, mask=ok, other=0.0)
            if HAS_RES:
                r = tl.load(RES + row * D + d0 + cols, mask=ok, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
                tl.store(X + row * D + d0 + cols, x, mask=ok)
            xf = x.to(tl.float32)
            acc += xf * xf
        tl.store(SQ + row, tl.sum(acc, axis=0))

    return add_sumsq_kernel


def add_sumsq(h: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h (n, d) [+ residual (n, d)] -> (x = h + residual, or h itself; |x|² (n,) fp32). Reference:
    `x = h + residual; x.float().square().sum(-1)`. One launch where the "gemm" injection had torch's norm
    reduction and SGLang's layer output its separate add; SGLang hands the stream over as (h, residual)."""
    n, D = h.shape
    h = h.contiguous()
    x = h if residual is None else torch.empty_like(h)
    sq = torch.empty(n, device=h.device, dtype=torch.float32)
    if n:
        res = h if residual is None else residual.contiguous()
        _sumsq_kernel()[(n,)](h, res, x, sq, D, HAS_RES=residual is not None, BLOCK=min(1024, _pow2(D)))
    return x, sq


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
