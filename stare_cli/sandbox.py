"""A Python code-interpreter tool for tool-integrated reasoning: every call runs in a fresh process.

Containment, per call:
- a throwaway working directory (deleted afterwards) as cwd, HOME and TMPDIR;
- resource limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE),
  processes (RLIMIT_NPROC), open files; a wall-clock limit kills the whole process group;
- when started as root, the code runs as an unprivileged user (nobody), so it cannot write outside
  its work directory except to world-writable places, and RLIMIT_NPROC applies (root ignores it);
- no network: a new network namespace when the kernel allows it (only loopback, down); otherwise
  the socket module is disabled in the child before the code runs (a weaker guard, reported in
  `Observation.isolation`);
- as root, also a private mount namespace in which /tmp, /var/tmp and /dev/shm are fresh tmpfs, so
  the only writable place that outlives the call is none (the work directory is deleted);
- output (stdout and stderr together) is read up to a byte limit and truncated.
A failure of the tool is an observation for the model, never an exception in the caller.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
SCRATCH = (b"/tmp", b"/var/tmp", b"/dev/shm")  # world-writable places, replaced by private tmpfs
PRELUDE = (
    "import socket as _s\n"
    "def _no_net(*a, **k):\n"
    "    raise OSError('network access is disabled in this sandbox')\n"
    "_s.socket = _no_net; _s.create_connection = _no_net; _s.getaddrinfo = _no_net\n"
)


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 16
    nproc: int = 32
    output_bytes: int = 4096


@dataclass(frozen=True)
class Observation:
    output: str
    exit_code: int
    status: str  # ok | error | timeout | killed | output-truncated
    elapsed_s: float
    isolation: str  # netns+tmpfs | netns | socket-guard

    def text(self) -> str:
        """What the model sees."""
        tail = "" if self.status in ("ok", "output-truncated") else f"\n[{self.status}]"
        return (self.output + tail).strip()


def _isolate(libc, mounts: bool) -> bool:
    """New network (and, as root, mount) namespace; world-writable dirs become private tmpfs.
    Returns whether the mount part worked."""
    if libc.unshare(CLONE_NEWNET | (CLONE_NEWNS if mounts else 0)) != 0:
        raise OSError(ctypes.get_errno(), "unshare failed")
    if not mounts:
        return False
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return False
    ok = True
    for d in SCRATCH:
        if os.path.isdir(d):
            ok &= libc.mount(b"tmpfs", d, b"tmpfs", 0, b"size=64m,mode=1777") == 0
    return ok


def _probe() -> str:
    """Which isolation this kernel allows: 'netns+tmpfs', 'netns' or 'socket-guard'."""
    try:
        pid = os.fork()
    except OSError:
        return "socket-guard"
    if pid == 0:
        try:
            mounted = _isolate(ctypes.CDLL(None, use_errno=True), os.geteuid() == 0)
            os._exit(0 if mounted else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return {0: "netns+tmpfs", 1: "netns"}.get(os.waitstatus_to_exitcode(status), "socket-guard")


_NETNS = None


def _world_executable(path: str) -> bool:
    p = os.path.realpath(path)
    parts = p.split(os.sep)
    for i in range(2, len(parts) + 1):
        d = os.sep.join(parts[:i])
        try:
            if not os.stat(d).st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


def interpreter(drop_privileges: bool) -> str:
    """A Python the sandboxed user can execute (the unprivileged user cannot enter /root)."""
    if not drop_privileges:
        return sys.executable
    for cand in (sys.executable, shutil.which("python3") or "", "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and _world_executable(cand):
            return cand
    raise OSError("no Python interpreter that an unprivileged user can run was found")


def run_python(code: str, limits: Limits = Limits()) -> Observation:
    """Run `code` with `python -I` in a fresh, limited process; return what it printed."""
    global _NETNS
    if _NETNS is None:
        _NETNS = _probe()
    netns = _NETNS != "socket-guard"
    work = tempfile.mkdtemp(prefix="stare-sbx-")
    as_root = os.geteuid() == 0
    if as_root:
        os.chmod(work, 0o777)
    uid = 65534  # nobody

    def preexec() -> None:  # runs in the child after chdir(work), before exec
        os.setsid()
        if netns:  # the work dir stays reachable as the cwd even under the private /tmp
            _isolate(ctypes.CDLL(None, use_errno=True), _NETNS == "netns+tmpfs")
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        mem = limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        size = limits.file_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        if as_root:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.nproc, limits.nproc))

    src = code if netns else PRELUDE + code
    env = {"HOME": work, "TMPDIR": work, "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    t0 = time.monotonic()
    status = "ok"
    try:
        proc = subprocess.Popen([interpreter(as_root), "-I", "-c", src], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=preexec)
    except OSError as e:
        shutil.rmtree(work, ignore_errors=True)
        return Observation(f"sandbox could not start: {e}", -1, "error", 0.0, _NETNS)
    out = bytearray()
    truncated = False
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        try:
            chunk = proc.stdout.read(65536)
        except BlockingIOError:
            chunk = None
        if chunk:
            if len(out) < limits.output_bytes:
                out += chunk[: limits.output_bytes - len(out)]
            if len(out) >= limits.output_bytes and not truncated:
                truncated = True
        if proc.poll() is not None and not chunk:
            break
        if time.monotonic() - t0 > limits.wall_s:
            status = "timeout"
            break
        if not chunk:
            time.sleep(0.005)
    try:  # the whole process group, also children that outlive the code's own process (fork bombs)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    code_ = proc.wait()
    elapsed = time.monotonic() - t0
    shutil.rmtree(work, ignore_errors=True)
    if status == "ok":
        if code_ < 0:
            sig = -code_
            status = "timeout" if sig in (signal.SIGXCPU, signal.SIGKILL) and elapsed >= limits.cpu_s else "killed"
        elif code_ != 0:
            status = "error"
        elif truncated:
            status = "output-truncated"
    text = out.decode("utf-8", errors="replace")
    if truncated:
        text += "\n[output truncated]"
    return Observation(text, code_, status, elapsed, _NETNS)
