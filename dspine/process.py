"""Child processes on 127.0.0.1: a free port, and waiting until a server answers (or its process exits)."""

from __future__ import annotations

import time


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
