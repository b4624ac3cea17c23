"""Drafters that ship with dspine: for each built-in target, a trained DSpine drafter (bf16 weights without
what the target recomputes; its training record beside it). `dspine ... --drafter builtin` and the servers'
default for a built-in target resolve here."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
BUILTIN = {"smollm2-135m-instruct": HERE / "smollm2-135m-instruct" / "dspine"}


def builtin_drafter(target: str) -> Path:
    """The shipped drafter of a built-in target (by its name) -> its checkpoint folder."""
    path = BUILTIN.get(target)
    if path is None:
        raise ValueError(f"no drafter ships for target {target!r}; built-in drafters exist for {sorted(BUILTIN)}")
    return path
