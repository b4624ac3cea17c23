"""fp32 linears on the CPU through oneDNN's prepacked weights (what torch's CPU inductor uses for frozen weights).

For the few rows of a decode step, a verify or a drafter block, oneDNN's packed kernels are faster than the BLAS
GEMM `F.linear` calls, whose speed also jumps around with the number of rows; and each row's result is the same
bits whatever the number of rows computed beside it (the BLAS GEMM's is not between 1 row and several), so a
verify row's logits equal a 1-row decode step's. The comparison: `dspine bench --backend engine` with
DSPINE_CPU_PACKED=1 and =0 (bench/results/README.md).

Only where nothing is differentiated and everything is fp32 on the CPU; anything else takes the plain path, so
training is unchanged. The packed copy follows its weight: repacked after an in-place change (the optimizer's
step, a load) or when the tensor is replaced. DSPINE_CPU_PACKED=0 turns it off.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
import torch.nn.functional as F

_PACKED: dict[int, tuple] = {}  # id(holder) -> (weakref to holder, weight key, packed weight); dropped with it


def packed_linears_available() -> bool:
    """oneDNN's packed fp32 linear exists in this torch and DSPINE_CPU_PACKED is not 0."""
    return (
        os.environ.get("DSPINE_CPU_PACKED", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _packable(x: torch.Tensor, w: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    return x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32


def _packed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, holder) -> torch.Tensor:
    key = (w.data_ptr(), w._version)
    entry = _PACKED.get(id(holder))
    if entry is None or entry[0]() is not holder or entry[1] != key:
        hid = id(holder)
        ref = weakref.ref(holder, lambda _, hid=hid: _PACKED.pop(hid, None))
        entry = _PACKED[hid] = (ref, key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
    return torch.ops.mkldnn._linear_pointwise(x, entry[2], b, "none", [], "")


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b): x (..., in), w (out, in) -> (..., out), packed where that applies. The packed copy is
    kept for the weight tensor while it lives; never pickled or copied with it."""
    if _packable(x, w) and packed_linears_available():
        return _packed(x, w, b, w)
    return F.linear(x, w, b)


def _forward(mod: torch.nn.Linear, plain, x: torch.Tensor) -> torch.Tensor:
    # availability was settled when the module was routed (pack_linears); the packed copy is kept for the module
    return _packed(x, mod.weight, mod.bias, mod) if _packable(x, mod.weight) else plain(x)


def pack_linears(model: torch.nn.Module) -> int:
    """Route the model's nn.Linear layers through oneDNN where it is available; returns how many were routed
    (none twice)."""
    if not packed_linears_available():
        return 0
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and "_dspine_plain" not in mod.__dict__:
            mod.__dict__["_dspine_plain"] = plain = mod.forward
            mod.forward = functools.partial(_forward, mod, plain)
            n += 1
    return n
