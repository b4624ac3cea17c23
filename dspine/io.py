"""Files: atomic writes (a temp file beside the target, then a rename), result JSON and Markdown tables, and the
provenance every result carries (git sha, hardware, command)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


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


def atomic_dir(path: str | Path, fill: Callable[[Path], None], replace: bool = True) -> Path:
    """Call `fill(tmp_dir)`, then rename the temp folder to `path`. An existing `path` is swapped out
    (replace=True) or kept, as when another process wrote the same folder first (replace=False)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        fill(tmp)
        old = None
        if path.exists() and replace:
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except OSError:  # not replacing: another writer won the race
            if replace or not path.exists():
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.eE+-]+(?:,\s*-?[\d.eE+-]+)*)\s*\]")


def json_text(doc) -> str:
    """Indented JSON whose lists of plain numbers (token ids, histograms) stay on one line each."""
    return (
        _NUMBER_LIST.sub(
            lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", json.dumps(doc, indent=1)
        )
        + "\n"
    )


def update_summary(path: str | Path, section: str, value: dict) -> None:
    """Replace one section of a results summary.json, keeping the others (temp file, then rename)."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[section] = value
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def comma_ints(text: str) -> list[int]:
    """ "1,4,8" -> [1, 4, 8] (empty items skipped): a list-of-integers command-line option."""
    return [int(x) for x in text.split(",") if x]


def md_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table: header cells, then one list of cells per row (each cell str()-ed)."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def git_sha() -> str:
    """DSPINE_GIT_SHA when set (the GPU machine's tree travels without its own history), else the checkout's."""
    if os.environ.get("DSPINE_GIT_SHA"):
        return os.environ["DSPINE_GIT_SHA"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        sha = ""
    return sha if re.fullmatch(r"[0-9a-f]{40}", sha) else "unknown"


def hardware() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({platform.node()})"
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} ({platform.node()})"


def provenance() -> dict:
    """What every result JSON carries: the git sha, the hardware and the command that produced it."""
    return {"git_sha": git_sha(), "hardware": hardware(), "command": " ".join(sys.argv)}
