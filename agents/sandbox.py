"""The jail every agent tool runs in: one episode directory, no network, CPU / memory / process / output /
wall-time limits. Standard library only: the parent (`Jail.run`) starts this file as a fresh, single-threaded
interpreter, which confines itself and then executes the tool's command, so nothing unsafe happens between
fork and exec in a threaded parent (a Ray worker, a server).

What confines the command, each applied where the kernel and the caller's privileges allow it:
- writes: Landlock (Linux >= 5.13, any user) — writes anywhere but the episode directory and /dev/null fail
  with EACCES; reads stay allowed (the command needs its interpreter and libraries);
- network: a new, empty network namespace (root), plus Landlock's TCP connect / bind denial (ABI >= 4, any user);
- processes: a cgroup-v1 `pids` group with `pids.max` (root: RLIMIT_NPROC does not bind uid 0), else
  RLIMIT_NPROC; the whole group is killed when the call ends or times out;
- CPU seconds, address space and file size by rlimits; output truncated by the parent; a wall-clock timeout;
- root keeps uid 0 (the interpreter may live under a private home) but loses every capability: the bounding set
  is emptied before exec, so it cannot raise its limits, leave its cgroup or undo the namespace.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Landlock (uapi/linux/landlock.h)
_SYS_CREATE, _SYS_ADD, _SYS_RESTRICT = 444, 445, 446
_FS_WRITE = {  # access right -> first ABI that has it
    1 << 1: 1,  # WRITE_FILE
    1 << 4: 1,  # REMOVE_DIR
    1 << 5: 1,  # REMOVE_FILE
    1 << 6: 1,  # MAKE_CHAR
    1 << 7: 1,  # MAKE_DIR
    1 << 8: 1,  # MAKE_REG
    1 << 9: 1,  # MAKE_SOCK
    1 << 10: 1,  # MAKE_FIFO
    1 << 11: 1,  # MAKE_BLOCK
    1 << 12: 1,  # MAKE_SYM
    1 << 13: 2,  # REFER
    1 << 14: 3,  # TRUNCATE
}
_FILE_RIGHTS = (1 << 1) | (1 << 14)  # the rights a rule on a single file may carry (WRITE_FILE, TRUNCATE)
_NET_BIND, _NET_CONNECT = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1
_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP = 38, 24
_CLONE_NEWNET = 0x40000000
_PIDS_ROOT = Path("/sys/fs/cgroup/pids")


@dataclass
class JailLimits:
    wall_s: float = 30.0  # per call
    cpu_s: int = 20
    memory_mb: int = 2048  # address space
    max_procs: int = 64  # processes and threads at once
    file_mb: int = 64  # largest file a call may write
    max_output: int = 20000  # characters of output returned (the rest is cut and counted)


@dataclass
class JailResult:
    output: str
    returncode: int
    timed_out: bool = False
    truncated_chars: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass
class Jail:
    """A directory and the limits its commands run under. `run(argv)` or `run_shell(text)` -> JailResult."""

    root: Path
    limits: JailLimits = field(default_factory=JailLimits)
    env: dict = field(default_factory=dict)

    def __post_init__(self):
        self.root = Path(self.root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ".tmp").mkdir(exist_ok=True)

    def run_shell(self, command: str, stdin: str | None = None) -> JailResult:
        return self.run(["/bin/bash", "-c", command], stdin=stdin)

    def run(self, argv: list[str], stdin: str | None = None) -> JailResult:
        cg = _PIDS_ROOT / f"dspine-jail-{uuid.uuid4().hex[:12]}" if _pids_cgroup_usable() else None
        spec = {"root": str(self.root), "limits": asdict(self.limits), "cgroup": str(cg) if cg else None}
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "TMPDIR": str(self.root / ".tmp"),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PAGER": "cat",
            **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
            **self.env,
        }
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", __file__, json.dumps(spec), "--", *argv],
            cwd=self.root,
            env=env,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, _ = proc.communicate(stdin.encode() if stdin is not None else None, timeout=self.limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_all(proc.pid, cg)
            out, _ = proc.communicate()
        finally:
            _kill_all(proc.pid, cg)
            if cg is not None:
                _remove_cgroup(cg)
        text = out.decode("utf-8", errors="replace")
        cut = max(0, len(text) - self.limits.max_output)
        if cut:
            half = self.limits.max_output // 2
            text = text[:half] + f"\n[... {cut} characters cut ...]\n" + text[-half:]
        if timed_out:
            text += f"\n[killed: the call ran past its {self.limits.wall_s:g} s limit]"
        rc = proc.returncode if not timed_out else -int(signal.SIGKILL)
        return JailResult(text, rc, timed_out, cut, time.monotonic() - t0)


def landlock_abi() -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return max(0, int(libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))))
    except (OSError, AttributeError):
        return 0


def _pids_cgroup_usable() -> bool:
    return os.geteuid() == 0 and os.access(_PIDS_ROOT, os.W_OK)


def _kill_all(pid: int, cg: Path | None) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if cg is None:
        return
    for _ in range(50):  # a fork bomb keeps forking while it is being killed: repeat until the group is empty
        try:
            pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _remove_cgroup(cg: Path) -> None:
    for _ in range(100):
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # processes still exiting
            time.sleep(0.05)


# ---- the launcher side: runs in the fresh interpreter, confines itself, then execs the command -------------
class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]


class _NetPort(ctypes.Structure):
    _fields_ = [("allowed", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def _landlock(root: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    abi = landlock_abi()
    if abi < 1:
        return
    fs = sum(bit for bit, since in _FS_WRITE.items() if abi >= since)
    net = (_NET_BIND | _NET_CONNECT) if abi >= 4 else 0
    scoped = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    rfd = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if rfd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    for path, rights in ((root, fs), ("/dev/null", fs & _FILE_RIGHTS)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = _PathBeneath(rights, fd)
        if libc.syscall(_SYS_ADD, rfd, 1, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path} failed")
        os.close(fd)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if libc.syscall(_SYS_RESTRICT, rfd, ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(rfd)


def _confine(spec: dict) -> None:
    lim = spec["limits"]
    libc = ctypes.CDLL(None, use_errno=True)
    if spec.get("cgroup"):
        cg = Path(spec["cgroup"])
        cg.mkdir()
        (cg / "pids.max").write_text(str(lim["max_procs"]))
        (cg / "cgroup.procs").write_text(str(os.getpid()))
    if os.geteuid() == 0 and libc.unshare(_CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
    mb = 1024 * 1024
    for res, value in (
        (resource.RLIMIT_CPU, lim["cpu_s"]),
        (resource.RLIMIT_AS, lim["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, lim["file_mb"] * mb),
        (resource.RLIMIT_NPROC, lim["max_procs"] + _user_processes()),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (value, value))
    _landlock(spec["root"])
    if os.geteuid() == 0:
        for cap in range(64):
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                break  # past the last capability this kernel knows


def _user_processes() -> int:
    """Processes the caller's uid already runs (RLIMIT_NPROC counts them all)."""
    uid, n = os.getuid(), 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                n += os.stat(f"/proc/{d}").st_uid == uid
            except OSError:
                pass
    return n


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    cmd = argv[argv.index("--") + 1 :]
    try:
        _confine(spec)
    except OSError as e:
        print(f"jail: cannot confine the command: {e}", file=sys.stderr)
        os._exit(126)
    os.chdir(spec["root"])
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"jail: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
