"""Runs one Python tool inside the jail: `python -c "from dspine.agents.toolrun import main; main()" MODULE:FUNCTION`
with the JSON arguments on stdin. Prints one marked line with {"ok", "result"} (a raised exception is a result
with ok false, its message the text the model reads). Imports nothing heavy itself."""

from __future__ import annotations

import importlib
import json
import sys

MARK = "@@dspine-tool-result@@ "


def main() -> None:
    spec = sys.argv[1]
    module, _, name = spec.partition(":")
    try:
        args = json.loads(sys.stdin.read() or "{}")
        fn = getattr(importlib.import_module(module), name)
        out = {"ok": True, "result": fn(**args)}
    except Exception as e:  # the tool's error is the tool's result
        out = {"ok": False, "result": f"Error: {type(e).__name__}: {e}"}
    sys.stdout.flush()
    print("\n" + MARK + json.dumps(out, default=str))


def parse(output: str, returncode: int = 0) -> tuple[bool, str]:
    """The jail's output -> (ok, text for the model): the result first, then what the tool printed. Without
    the marked line the tool died: how it ended (killed, out of memory, ...) is the result."""
    head, mark, tail = output.rpartition(MARK)
    if not mark:
        how = (
            f"killed by signal {-returncode} (a CPU, memory or time limit)" if returncode < 0 else f"exit {returncode}"
        )
        return False, f"Error: the tool did not finish ({how}): " + output.strip()[-1500:]
    try:
        out = json.loads(tail.strip().splitlines()[0])
    except (json.JSONDecodeError, IndexError):
        return False, "Error: the tool's result could not be read"
    res = out["result"]
    text = res if isinstance(res, str) else json.dumps(res)
    noise = head.strip()
    return bool(out["ok"]), (text + "\n[printed]\n" + noise[-1500:]) if noise else text
