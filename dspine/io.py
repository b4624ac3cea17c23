"""Atomic file writes: write a temp file beside the target, then rename it into place."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Callable


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call `write(tmp_path)`, then rename the temp file to `path`; nothing half-written is ever left."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def json_text(doc) -> str:
    """Indented JSON whose lists of plain numbers (token ids, histograms) stay on one line each."""
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]",
                            json.dumps(doc, indent=1)) + "\n"
