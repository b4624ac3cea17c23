"""Child processes on 127.0.0.1: a free port, waiting until a server answers (or its process exits), and telling
whether a PID saved earlier is still the process that was started (not a later one that took its number)."""

from __future__ import annotations

import threading
import time

_GIVEN: set[int] = set()  # ports free_port handed out in this process
_LOCK = threading.Lock()


def free_port() -> int:
    """A port nothing listens on now, and never one this process was given before: the kernel may hand the same
    free port to two asks in a row (a Ray head's GCS and dashboard both on one port), which nothing listens on
    between the ask and the child's bind."""
    import socket

    with _LOCK:
        for _ in range(1000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port
    raise RuntimeError("no free port on 127.0.0.1 that this process was not given already")


def wait_http(url: str, proc, seconds: float = 120) -> None:
    """Until `url` answers 200; raises with the process's output if it exits first."""
    import urllib.request

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=1).status == 200:
                return
        except OSError:
            if proc.poll() is not None:
                out = proc.stdout.read().decode()[-3000:] if proc.stdout else ""
                raise RuntimeError(f"{' '.join(map(str, proc.args[:4]))} exited: {out}") from None
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{url} did not come up within {seconds:.0f} s")


def process_identity(pid: int) -> dict | None:
    """What tells a process apart from a later one with the same PID: its start time (clock ticks after boot) and
    its command line, from /proc; None where the process is gone (or /proc is absent)."""
    from pathlib import Path

    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return {"start_ticks": int(fields[19]), "cmdline": cmdline.decode(errors="replace").split("\0")[:-1]}


def same_process(pid: int, identity: dict | None) -> bool:
    """Whether `pid` is still the process whose process_identity was saved (False when gone or replaced)."""
    return identity is not None and process_identity(pid) == identity
