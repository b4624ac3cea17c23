"""fp32 linears on the CPU through oneDNN's prepacked weights (what torch's CPU inductor uses for frozen weights),
and, for drafters only, through int8 weights.

For the few rows of a decode step, a verify or a drafter block, oneDNN's packed kernels are faster than the BLAS
GEMM `F.linear` calls, whose speed also jumps around with the number of rows; and each row's result is the same
bits whatever the number of rows computed beside it (the BLAS GEMM's is not between 1 row and several), so a
verify row's logits equal a 1-row decode step's. The comparison: `dspine bench --backend engine` with
DSPINE_CPU_PACKED=1 and =0 (bench/results/README.md).

Only where nothing is differentiated and everything is fp32 on the CPU; anything else takes the plain path, so
training is unchanged. The packed copy follows its weight: repacked after an in-place change (the optimizer's
step, a load) or when the tensor is replaced. DSPINE_CPU_PACKED=0 turns it off.

int8 (`pack_linears(model, int8=True)`, `linear(..., int8=True)`): the weight quantised per output channel
(symmetric, scale = max|w| / 127) and prepacked once for fbgemm's dynamic linear, which quantises each call's
activations per tensor and accumulates in int32 — a quarter of the fp32 bytes, where a CPU decode step is bound
by memory traffic. Only for drafts, which need no exactness (the target verifies every token in its own dtype);
never for a target.
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref

import torch
import torch.nn.functional as F

_PACKED: dict[int, tuple] = {}  # id(holder) -> (weakref to holder, weight key, packed weight); dropped with it
_INT8: dict[int, tuple] = {}  # the same for int8 prepacked weights


def packed_linears_available() -> bool:
    """oneDNN's packed fp32 linear exists in this torch and DSPINE_CPU_PACKED is not 0."""
    return (
        os.environ.get("DSPINE_CPU_PACKED", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def int8_linears_available() -> bool:
    """fbgemm's (x86) dynamic int8 linear exists in this torch (torch has deprecated quantized tensors, which
    `quantize_int8` builds the prepacked weight from: where they are gone, drafts stay in fp32)."""
    engines = torch.backends.quantized.supported_engines
    ops = hasattr(torch, "quantize_per_channel") and hasattr(torch.ops.quantized, "linear_dynamic")
    return ("x86" in engines or "fbgemm" in engines) and ops


def _packable(x: torch.Tensor, w: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return False
    return x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32


def _kept(store: dict, holder, key: tuple, make):
    """The copy `store` keeps for `holder` (made again when `key` — the weight's pointer and version — changed)."""
    entry = store.get(id(holder))
    if entry is None or entry[0]() is not holder or entry[1] != key:
        hid = id(holder)
        ref = weakref.ref(holder, lambda _, hid=hid: store.pop(hid, None))
        entry = store[hid] = (ref, key, make())
    return entry[2]


def _packed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, holder) -> torch.Tensor:
    packed = _kept(
        _PACKED, holder, (w.data_ptr(), w._version), lambda: torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
    )
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")


def quantize_int8(w: torch.Tensor, b: torch.Tensor | None = None):
    """w (out, in) fp32 -> fbgemm's prepacked int8 weight (per-channel symmetric scales) with bias b."""
    w = w.detach().float().contiguous()
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch; fbgemm's dynamic linear is not gone
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None if b is None else b.detach().float())


def _int8(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, holder) -> torch.Tensor:
    key = (w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version))  # the bias is packed in
    packed = _kept(_INT8, holder, key, lambda: quantize_int8(w, b))
    shape = x.shape
    y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).contiguous(), packed, True)
    return y.reshape(*shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, int8: bool = False) -> torch.Tensor:
    """F.linear(x, w, b): x (..., in), w (out, in) -> (..., out), packed where that applies (`int8`: through int8
    weights, see the module's docstring). The packed copy is kept for the weight tensor while it lives; never
    pickled or copied with it."""
    if _packable(x, w):
        if int8:
            return _int8(x, w, b, w)
        if packed_linears_available():
            return _packed(x, w, b, w)
    return F.linear(x, w, b)


def _forward(mod: torch.nn.Linear, plain, x: torch.Tensor) -> torch.Tensor:
    # the packed copy is kept for the module (pack_linears routed it here)
    if not _packable(x, mod.weight):
        return plain(x)
    if mod.__dict__["_dspine_int8"]:
        return _int8(x, mod.weight, mod.bias, mod)
    return _packed(x, mod.weight, mod.bias, mod)


def pack_linears(model: torch.nn.Module, int8: bool = False) -> int:
    """Route the model's nn.Linear layers through oneDNN where it is available, or (`int8`) through int8 weights
    (an error where fbgemm is missing); returns how many were routed anew, switched between the two, or (fp32
    asked where oneDNN is missing) given back their plain forward — none twice."""
    if int8 and not int8_linears_available():
        raise RuntimeError("int8 linears need torch's fbgemm (x86) quantized engine, which this torch lacks")
    wrap = int8 or packed_linears_available()  # settled here, not per call
    n = 0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        routed = "_dspine_plain" in mod.__dict__
        if not wrap:
            if routed:
                for k in ("forward", "_dspine_plain", "_dspine_int8"):  # the class's forward again
                    del mod.__dict__[k]
                n += 1
            continue
        if routed and mod.__dict__["_dspine_int8"] == int8:
            continue
        if not routed:
            mod.__dict__["_dspine_plain"] = plain = mod.forward
            mod.forward = functools.partial(_forward, mod, plain)
        mod.__dict__["_dspine_int8"] = int8
        n += 1
    return n
