"""Triton kernels beside their eager references in dspine/ (each module names its reference).

Triton is imported lazily, inside the kernel builders, so CPU installs without it work. `enabled(x)` says
whether a tensor's computation should take the fused path: on CUDA, without autograd (the kernels have no
backward), unless DSPINE_KERNELS=0. `fused_width_ok(x)` adds the width rule of the transition-score kernel:
it wins at narrow widths and loses to cuBLAS-backed torch at wide ones (bench/kernels.py --hidden;
bench/results/README.md), so above DSPINE_FUSED_MAX_WIDTH (default 1024) the eager scores run; the
injection switches to its cuBLAS-backed layout there instead (injection.injection_variant).
"""

from __future__ import annotations

import functools
import os


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enabled(x) -> bool:
    import torch

    return x.is_cuda and not torch.is_grad_enabled() and os.environ.get("DSPINE_KERNELS", "1") != "0" and available()


def fused_max_width() -> int:
    """The widest model served by the fused transition scores and the "split" injection (DSPINE_FUSED_MAX_WIDTH,
    1024)."""
    return int(os.environ.get("DSPINE_FUSED_MAX_WIDTH", "1024"))


def fused_width_ok(x) -> bool:
    """enabled(x), and x's last dimension (the model width) at most fused_max_width()."""
    return enabled(x) and x.shape[-1] <= fused_max_width()


def setting(env: str, allowed: tuple[str, ...], default: str, value: str | None = None) -> str:
    """A kernel choice: `value`, else the environment variable `env`, else `default`; one of `allowed`."""
    v = value or os.environ.get(env, default)
    if v not in allowed:
        raise ValueError(f"{env}={v!r}: one of {allowed}")
    return v
