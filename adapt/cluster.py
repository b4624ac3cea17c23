"""A Ray head of our own on 127.0.0.1, for the demo and the tests: started in its own session with its own temp
dir (under /tmp, removed on stop) and ports, and stopped by the ids of the processes it started — never by Ray's
own stop command, which ends every Ray process on the machine, other users' clusters included.

`ray start --head --block` stays in the foreground as the parent of the head's processes (GCS, raylet, dashboard,
workers); `stop()` signals that process tree, found through /proc, and nothing else. The `ray` command line is run
as a program: nothing here imports ray.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from dspine.process import free_port


def ray_env() -> dict:
    """The environment a one-machine head and its jobs run in: every Ray address stays 127.0.0.1 (Ray otherwise
    swaps it for the interface address), no usage stats, no token auth."""
    return {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONUNBUFFERED": "1",
    }


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children first, then theirs), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def end_tree(root: int, pids: list[int], grace: float, reap=lambda: None) -> None:
    """SIGTERM to `pids`, SIGKILL to what outlives `grace` seconds (and to what appeared below `root` meanwhile)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + (grace if sig == signal.SIGTERM else 5)
        while time.time() < deadline and any(alive(p) for p in pids):
            reap()
            time.sleep(0.2)
        pids = [p for p in pids + descendants(root) if alive(p)]
        if not pids:
            break


class LocalRayHead:
    """`with LocalRayHead() as head:` — head.address (GCS, for ray.init / RAY_ADDRESS), head.dashboard (the job
    API, for `ray job submit --address`), head.env; its processes end when the block does."""

    def __init__(self, num_cpus: int | None = None, start_timeout: float = 180, num_gpus: int | None = None):
        self.env = ray_env()
        self.port, self.dash_port = free_port(), free_port()
        # short: Ray's unix sockets live below it (at most 107 bytes a path); removed by stop()
        self.temp_dir = tempfile.mkdtemp(prefix="dsray-", dir="/tmp")
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dash_port}"
        cmd = [
            "ray",
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(self.dash_port),
            # the agent's HTTP port (jobs go through it) is fixed by default: a second head on the machine would
            # start without it and refuse every job ("No available agent")
            "--dashboard-agent-listen-port",
            str(free_port()),
            "--temp-dir",
            self.temp_dir,
            "--num-cpus",
            str(num_cpus or os.cpu_count() or 2),
            "--disable-usage-stats",
        ]
        if num_gpus is not None:  # default: Ray counts the GPUs it sees
            cmd += ["--num-gpus", str(num_gpus)]
        self.log = open(Path(self.temp_dir) / "ray-start.log", "wb")
        self.proc = subprocess.Popen(
            cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait(start_timeout)

    def _wait(self, seconds: float) -> None:
        """Until the job API answers; the head's own log in the error if `ray start` exits or times out."""
        import urllib.request

        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited ({self.proc.returncode}): {self._log_tail()}")
            try:
                with urllib.request.urlopen(self.dashboard + "/api/version", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Ray head did not answer within {seconds:.0f} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        self.log.flush()
        return (Path(self.temp_dir) / "ray-start.log").read_text(errors="replace")[-2000:]

    def record(self) -> dict:
        """What a later process needs to use this head and to stop it (`stop_recorded`): addresses, temp dir, and
        the pid and identity of `ray start`."""
        from dspine.process import process_identity

        return {
            "address": self.address,
            "dashboard": self.dashboard,
            "temp_dir": self.temp_dir,
            "pid": self.proc.pid,
            "identity": process_identity(self.proc.pid),
        }

    def pids(self) -> list[int]:
        """`ray start` and every process below it: the head's processes, and only those."""
        return [self.proc.pid, *descendants(self.proc.pid)] if self.proc.poll() is None else descendants(self.proc.pid)

    def stop(self, grace: float = 20) -> None:
        """SIGTERM to the head's processes (ray start then stops the rest in order), SIGKILL to what outlives
        `grace` seconds."""
        end_tree(self.proc.pid, self.pids(), grace, reap=self.proc.poll)  # reaps ray start itself
        self.proc.poll()
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayHead:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_recorded(rec: dict, grace: float = 20) -> bool:
    """Stop a head another process started (LocalRayHead.record) — only if its `ray start` is still that process
    (start time and command line as recorded) -> whether it was running."""
    from dspine.process import same_process

    if not same_process(rec["pid"], rec.get("identity")):
        return False
    end_tree(rec["pid"], [rec["pid"], *descendants(rec["pid"])], grace)
    shutil.rmtree(rec["temp_dir"], ignore_errors=True)
    return True
