"""Fused adjacent injection for one drafter layer (Triton).

Reference: `dspine.drafter.Injection.forward` — readout f = R·rms(h) + b_R of every slot, predecessor
p_t = f_{t-1} (slot 1: the anchor's code T[x_0]), gate σ(A f_t + b + P p_t), message M p_t, write-back
h_t += W (gate ⊙ message) for slots t >= 1, all slots in parallel from the pre-update features.

One program owns BLOCK_M consecutive (row, slot) pairs. It computes the readouts of its own slots and of
their predecessors (the slot one row up: "both features"), so no second pass or grid-wide sync is needed;
the RMS scale is applied after the readout product (R·(h·s) = s·(R·h)). fp32 uses IEEE dots (parity with
the reference); bf16 inputs use TF32, which represents bf16 exactly.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def injection_kernel(H, OUT, F, ANC, WR, BR, WA, BA, WP, WM, WW, n_rows, B, R, S, eps, D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_S: tl.constexpr, PREC: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        live = rows < n_rows
        slot = rows % B
        blk = rows // B
        prev_live = live & (slot >= 2)
        rr = tl.arange(0, BLOCK_R)
        ss = tl.arange(0, BLOCK_S)
        dd = tl.arange(0, BLOCK_D)
        r_ok = rr < R
        s_ok = ss < S
        # readouts of the own and the predecessor slots, unnormalised, plus their sums of squares
        f_own = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
        f_prev = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
        sq_own = tl.zeros((BLOCK_M,), tl.float32)
        sq_prev = tl.zeros((BLOCK_M,), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d_ok = (d0 + dd) < D
            x = tl.load(H + rows[:, None] * D + d0 + dd[None, :], mask=live[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            xp = tl.load(H + (rows - 1)[:, None] * D + d0 + dd[None, :], mask=prev_live[:, None] & d_ok[None, :],
                         other=0.0).to(tl.float32)
            wr = tl.load(WR + rr[None, :] * D + d0 + dd[:, None], mask=r_ok[None, :] & d_ok[:, None], other=0.0).to(tl.float32)
            f_own += tl.dot(x, wr, input_precision=PREC)
            f_prev += tl.dot(xp, wr, input_precision=PREC)
            sq_own += tl.sum(x * x, axis=1)
            sq_prev += tl.sum(xp * xp, axis=1)
        br = tl.load(BR + rr, mask=r_ok, other=0.0).to(tl.float32)
        f_own = f_own * tl.rsqrt(sq_own / D + eps)[:, None] + br[None, :]
        f_prev = f_prev * tl.rsqrt(sq_prev / D + eps)[:, None] + br[None, :]
        anc = tl.load(ANC + blk[:, None] * R + rr[None, :], mask=(live & (slot == 1))[:, None] & r_ok[None, :],
                      other=0.0).to(tl.float32)
        p = tl.where((slot == 1)[:, None], anc, f_prev)
        tl.store(F + rows[:, None] * R + rr[None, :], f_own.to(F.dtype.element_ty), mask=live[:, None] & r_ok[None, :])
        # gate and message: (BLOCK_M, R) x (R, S)
        w_mask = r_ok[:, None] & s_ok[None, :]
        wa = tl.load(WA + ss[None, :] * R + rr[:, None], mask=w_mask, other=0.0).to(tl.float32)
        wp = tl.load(WP + ss[None, :] * R + rr[:, None], mask=w_mask, other=0.0).to(tl.float32)
        wm = tl.load(WM + ss[None, :] * R + rr[:, None], mask=w_mask, other=0.0).to(tl.float32)
        ba = tl.load(BA + ss, mask=s_ok, other=0.0).to(tl.float32)
        g = tl.dot(f_own, wa, input_precision=PREC) + tl.dot(p, wp, input_precision=PREC) + ba[None, :]
        msg = tl.sigmoid(g) * tl.dot(p, wm, input_precision=PREC)
        writes = live & (slot >= 1)
        for d0 in range(0, D, BLOCK_D):
            d_ok = (d0 + dd) < D
            ww = tl.load(WW + (d0 + dd)[None, :] * S + ss[:, None], mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            x = tl.load(H + rows[:, None] * D + d0 + dd[None, :], mask=live[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            y = x + tl.where(writes[:, None], tl.dot(msg, ww, input_precision=PREC), 0.0)
            tl.store(OUT + rows[:, None] * D + d0 + dd[None, :], y.to(OUT.dtype.element_ty), mask=live[:, None] & d_ok[None, :])

    return injection_kernel


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (int(n) - 1).bit_length())


def fused_injection(inj, h: torch.Tensor, anchor_code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as Injection.forward: h (N, nb, B, d), anchor_code (N, nb, r) -> (h updated, f (N, nb, B, r))."""
    N, nb, B, D = h.shape
    R, S = inj.readout.out_features, inj.message.out_features
    h = h.contiguous()
    out = torch.empty_like(h)
    f = torch.empty(N, nb, B, R, device=h.device, dtype=h.dtype)
    n_rows = N * nb * B
    BLOCK_M = 16
    grid = (triton_cdiv(n_rows, BLOCK_M),)
    _kernel()[grid](h, out, f, anchor_code.to(h.dtype).contiguous(), inj.readout.weight, inj.readout.bias,
                    inj.gate_f.weight, inj.gate_f.bias, inj.gate_p.weight, inj.message.weight, inj.write.weight,
                    n_rows, B, R, S, float(torch.finfo(h.dtype).eps), D=D,
                    BLOCK_M=BLOCK_M, BLOCK_D=64, BLOCK_R=_pow2(R), BLOCK_S=_pow2(S),
                    PREC="ieee" if h.dtype == torch.float32 else "tf32")
    return out, f


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
