"""A Python code-interpreter tool for tool-integrated reasoning: every call is isolated from the host
and from every other call, and fails closed.

Each call runs in new user, mount, PID, network, IPC, UTS and cgroup namespaces (the launcher is
benchmarks/generation/_sandbox_init.py), which gives, per call:
- its own filesystem view: the system directories (/usr, /lib, ...) and the interpreter's
  installation read-only; private tmpfs for /tmp, HOME (/home/sandbox, the working directory) and
  /dev/shm, of `file_mb` each; a minimal /dev; no /proc (its per-process files would show the mount
  table with the host's device and bind sources, and the host uid), no /run, /var, /sys, no host home
  directory, no other calls' files, no host UNIX sockets. Nothing is written on the host, so nothing
  is left behind when the caller is killed;
- its own processes: PID 1 of the call's namespace is the launcher; when the code's process exits,
  everything it started (daemons after double fork and setsid included) is killed by the kernel. The
  launcher dies with the caller (parent-death signals down the chain), so killing the trainer kills
  the call;
- its own uid: uid 0 of its namespace, with every capability dropped for good (bounding set,
  securebits, no_new_privs). When the caller is root, that uid is a host uid of its own from a pool
  (one per concurrent call, held by a lock file); otherwise it is the caller's uid, which the
  read-only mounts and the namespaces keep from touching anything of the caller's;
- no network: a network namespace with no interface up (`import _socket` does not help);
- limits: CPU seconds, address space, file size, open files and processes (counted per namespace),
  plus a wall-clock limit enforced by the caller. Memory is limited for the call as a whole where a
  memory cgroup can be made (cgroup v1's memory controller, or v2's with the controller delegated; as
  root, typically): every process, its page cache, and memfd and tmpfs pages count toward
  `memory_mb`, swap too, and the kernel's OOM killer ends the call past it. Elsewhere only the
  per-process address-space limit holds (a warning says so at start; see `memory_cgroup_problem`);
- an environment of its own (HOME, TMPDIR that exist, PATH, LANG): nothing of the caller's (API
  keys) is passed; an interpreter with numpy and sympy (by default the one running stare, whose
  environment has both; `rollout.tools.python` / `Limits.python` chooses another).
Output (stdout and stderr together) is read up to a byte limit and truncated.

Fails closed: when this kernel does not allow the namespaces, `require_isolation` raises (training
and `stare eval --tools` refuse to start) and `run_python` returns an error observation instead of
running the code. `unsafe_no_isolation` (recipe key rollout.tools.unsafe_no_isolation, `stare eval
--unsafe-no-sandbox`) runs code with only resource limits, a new session and a throwaway directory,
with a warning on every start: only for code you trust.

A failure of the tool is an observation for the model, never an exception in the caller.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import itertools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from stare_kernel.errors import StareError

INIT = Path(__file__).with_name("_sandbox_init.py")
# The launcher's argv: argv[0] a name, not the interpreter's path; its source arrives on stdin first
# (a line with its length in bytes, the source, then the configuration JSON).
LAUNCHER_ARGV = ["stare-sandbox", "-I", "-S", "-c",
                 "import sys;b=sys.stdin.buffer;n=int(b.readline());exec(compile(b.read(n),'_sandbox_init.py','exec'))"]
POOL_SIZE = 256  # concurrent calls with a uid of their own (when the caller is root)
SETUP_FAILED = 125


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 16  # largest file, and the size of each private tmpfs
    nproc: int = 32  # processes (and threads) in the call's namespace
    output_bytes: int = 4096
    python: Optional[str] = None  # the interpreter the code runs with (None: the one running stare)
    unsafe_no_isolation: bool = False  # the opt-out: resource limits only (warned on every start)


@dataclass(frozen=True)
class Observation:
    output: str
    exit_code: int
    status: str  # ok | error | timeout | killed | output-truncated
    elapsed_s: float
    isolation: str  # namespaces | none (unsafe_no_isolation)
    memory_peak_mb: Optional[float] = None  # the call's peak (all its processes, shmem included), when a cgroup held it

    def text(self) -> str:
        """What the model sees."""
        tail = "" if self.status in ("ok", "output-truncated") else f"\n[{self.status}]"
        return (self.output + tail).strip()


# ------------------------------------------------------------------------------------- interpreter
@functools.lru_cache(maxsize=8)
def interpreter_info(python: Optional[str]) -> dict:
    """The interpreter's path and the directories it needs (its prefixes), and whether numpy and
    sympy import in it. Raises StareError when it does not run."""
    exe = python or sys.executable
    probe = ("import sys, os, json, importlib.util as u\n"
             "print(json.dumps({'exe': os.path.abspath(sys.executable), 'real': os.path.realpath(sys.executable),"
             " 'prefixes': sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}),"
             " 'missing': [m for m in ('numpy', 'sympy') if u.find_spec(m) is None]}))")
    try:
        out = subprocess.run([exe, "-I", "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
        info = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise StareError(f"the sandbox interpreter '{exe}' does not run: {e}",
                         hint="set rollout.tools.python to a Python 3 interpreter") from None
    paths = {*info["prefixes"], os.path.dirname(info["real"]), os.path.dirname(info["exe"])}
    info["ro_paths"] = sorted(p for p in paths if p and p != "/")
    return info


# ------------------------------------------------------------------------------------- uid pool
def _pool_base() -> int:
    """The first uid of the pool: the top of this (possibly nested) user namespace's mapped range,
    below the conventional nobody/nogroup ids."""
    tops = []
    for f in ("/proc/self/uid_map", "/proc/self/gid_map"):
        try:
            rows = [line.split() for line in Path(f).read_text().splitlines()]
            tops.append(max(int(r[0]) + int(r[2]) for r in rows))
        except (OSError, ValueError):
            tops.append(65536)
    top = min(min(tops), 2**31)
    return top - 2 - POOL_SIZE if top > 65536 else 65534 - 1 - POOL_SIZE


def _private_dir_fd(d: Path) -> int:
    """A descriptor of `d`, created as a directory of ours (mode 0700), or an OSError naming why it is
    not: another user's folder, a symlink, or one others can write (who could swap its lock files for
    symlinks). The folder is opened once, never through a symlink, and checked through that
    descriptor: whoever can write the folder above cannot swap it between the check and the use
    (files are then opened relative to the descriptor)."""
    import stat as _stat

    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(f"{d} is not a directory of ours (a symlink or a file): remove it, or set TMPDIR") from None
        raise
    st = os.fstat(fd)
    if not _stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise OSError(f"{d} belongs to uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}, not to us with 0700: "
                      "remove it, or set TMPDIR")
    return fd


POOL_DIR_NAME = "stare-sandbox-uids"


class _UidSlot:
    """A host uid of its own for one call (caller root only), held with an exclusive lock file."""

    def __init__(self):
        self.uid: Optional[int] = None
        self._file = None

    def __enter__(self) -> "_UidSlot":
        if os.geteuid() != 0:
            return self
        folder = Path(tempfile.gettempdir()) / POOL_DIR_NAME
        d = _private_dir_fd(folder)
        try:
            for slot in range(POOL_SIZE):
                # in the folder checked above, never through a symlink, never truncating: a lock file is
                # only ever created or opened
                try:
                    fd = os.open(f"{slot}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=d)
                except OSError as e:
                    raise OSError(f"{folder / f'{slot}.lock'} cannot be a lock file ({e.strerror}; a symlink is "
                                  "never followed): remove the folder, or set TMPDIR") from None
                f = os.fdopen(fd, "r+")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    f.close()
                    continue
                self.uid, self._file = _pool_base() + slot, f
                return self
        finally:
            os.close(d)
        raise OSError(f"all {POOL_SIZE} sandbox uids are in use")

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()  # releases the lock


# ---------------------------------------------------------------------------- memory cgroup
_CALLS = itertools.count()


@dataclass(frozen=True)
class _CgroupHome:
    """The cgroup folder under which each call gets a memory cgroup of its own."""

    path: Optional[Path]
    version: int  # 1 (the v1 memory hierarchy) or 2 (unified)
    problem: Optional[str]  # why calls cannot have one (path None)


def _own_cgroup_dirs() -> list[tuple[int, Path]]:
    """(version, folder) of this process's memory cgroup in each mounted hierarchy that has one."""
    mounts = []  # (fstype, root inside the hierarchy, mount point, super options)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            mounts.append((tail[0], fields[3], fields[4].replace("\\040", " "), tail[2]))
    out = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            want = [m for m in mounts if m[0] == "cgroup2"]
            version = 2
        elif "memory" in controllers.split(","):
            want = [m for m in mounts if m[0] == "cgroup" and "memory" in m[3].split(",")]
            version = 1
        else:
            continue
        for _, root, point, _ in want:
            if path == root or path.startswith(root.rstrip("/") + "/"):
                out.append((version, Path(point) / path[len(root):].lstrip("/")))
                break
    return sorted(out, key=lambda vp: vp[0])  # v1's memory hierarchy first: v2's is empty where v1 holds it


_HOME_LOCK = threading.Lock()


def _cgroup_home() -> _CgroupHome:
    """Where per-call memory cgroups can be made (found once per process, under a lock: the first
    calls may start together in rollout threads)."""
    with _HOME_LOCK:
        return _find_cgroup_home()


@functools.lru_cache(maxsize=1)
def _find_cgroup_home() -> _CgroupHome:
    """Find where per-call memory cgroups can be made: a probe folder is made and removed."""
    tried = []
    try:
        candidates = _own_cgroup_dirs()
    except OSError as e:
        return _CgroupHome(None, 0, f"cannot read this process's cgroups ({e})")
    for version, d in candidates:
        if version == 2:
            try:
                if "memory" not in (d / "cgroup.controllers").read_text().split():
                    tried.append(f"{d}: no memory controller delegated")
                    continue
                if "memory" not in (d / "cgroup.subtree_control").read_text().split():
                    (d / "cgroup.subtree_control").write_text("+memory")  # fails where d holds processes itself
            except OSError as e:
                tried.append(f"{d}: cannot enable the memory controller for sub-groups ({e.strerror})")
                continue
        probe = d / f"stare-call-{os.getpid()}-probe-{threading.get_ident()}"  # unique: calls may start in threads
        try:
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError as e:
            tried.append(f"{d}: cannot make a sub-group ({e.strerror})")
            continue
        _remove_stale_call_groups(d)
        return _CgroupHome(d, version, None)
    return _CgroupHome(None, 0, "; ".join(tried) or "no memory cgroup controller is mounted")


def _remove_stale_call_groups(d: Path) -> None:
    """Call groups left by a caller that was killed (its pid gone): empty, so they can be removed."""
    for g in d.glob("stare-call-*"):
        pid = g.name.split("-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                os.rmdir(g)
            except OSError:
                pass


def memory_cgroup_problem() -> Optional[str]:
    """Why a call's memory cannot be limited as a whole here (None when it can)."""
    return _cgroup_home().problem


class _CallCgroup:
    """A memory cgroup for one call: made before the launcher starts (the launcher joins it before it
    forks anything, so every process of the call is in it), read and removed after the call."""

    def __init__(self, memory_mb: int):
        self.memory_mb = memory_mb
        self.home = _cgroup_home()
        self.path: Optional[Path] = None

    def __enter__(self) -> "_CallCgroup":
        if self.home.path is None:
            return self
        d = self.home.path / f"stare-call-{os.getpid()}-{next(_CALLS)}"
        os.mkdir(d)
        self.path = d
        limit = str(self.memory_mb * 1024 * 1024)
        try:  # fail closed: a call whose group could not be limited does not run
            if self.home.version == 1:
                (d / "memory.limit_in_bytes").write_text(limit)
                if (d / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no way out through swap
                    (d / "memory.memsw.limit_in_bytes").write_text(limit)
            else:
                (d / "memory.max").write_text(limit)
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                if (d / "memory.oom.group").exists():  # the OOM killer ends the whole call, not one process
                    (d / "memory.oom.group").write_text("1")
        except OSError:
            self._remove()
            raise
        return self

    def finish(self) -> tuple[Optional[float], bool]:
        """(peak MB, whether the OOM killer acted) of the call once its processes are gone (the kernel
        ends them after the launcher's kill), then the group removed. (None, False) without a group."""
        if self.path is None:
            return None, False
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                if not (self.path / "cgroup.procs").read_text().strip():
                    break
            except OSError:
                break
            time.sleep(0.005)
        usage = self._usage()
        self._remove()
        return usage

    def _usage(self) -> tuple[Optional[float], bool]:
        mb = 1024 * 1024

        def read(name: str) -> Optional[str]:
            try:
                return (self.path / name).read_text()
            except OSError:
                return None

        peak = read("memory.max_usage_in_bytes" if self.home.version == 1 else "memory.peak")
        events = read("memory.oom_control" if self.home.version == 1 else "memory.events") or ""
        kills = dict(line.split()[:2] for line in events.splitlines() if len(line.split()) >= 2)
        oom = int(kills.get("oom_kill", 0)) > 0  # a process of the call was killed for the group's limit
        return (int(peak) / mb if peak else None), oom

    def _remove(self) -> None:
        """rmdir, once the call's processes are gone (the kernel ends them after the launcher's kill)."""
        deadline = time.monotonic() + 5.0
        while self.path is not None:
            try:
                os.rmdir(self.path)
                self.path = None
            except FileNotFoundError:
                self.path = None
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    self.path = None  # left for _remove_stale_call_groups once this process is gone
                else:
                    time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        self._remove()


# ------------------------------------------------------------------------------- availability
_CHECK_LOCK = threading.Lock()
_PROBLEM: dict[Optional[str], Optional[str]] = {}
_WARNED = False
_WARNED_MEMORY = False


def isolation_problem(python: Optional[str] = None) -> Optional[str]:
    """Why full isolation is not available here (None when it is): one real call, cached."""
    with _CHECK_LOCK:
        if python not in _PROBLEM:
            try:
                info = interpreter_info(python)
            except StareError as e:
                _PROBLEM[python] = str(e)
                return _PROBLEM[python]
            o = _run_isolated("print('ok')", Limits(python=python, cpu_s=10, wall_s=30), info)
            problem = None if (o.status, o.output.strip()) == ("ok", "ok") else (o.output.strip() or o.status)
            if problem and POOL_DIR_NAME in problem:
                return problem  # the uid pool's folder, not the isolation: not kept (removing the folder fixes it)
            _PROBLEM[python] = problem
        return _PROBLEM[python]


def require_isolation(limits: Limits) -> str:
    """Call before a run that uses the tool: raises StareError when the calls could not be isolated
    (unless the opt-out is set, which is warned about loudly). Returns the isolation in use."""
    global _WARNED
    if limits.unsafe_no_isolation:
        if not _WARNED:
            print("WARNING: the tool sandbox is OFF (unsafe_no_isolation): model-written code runs with your "
                  "user's rights, sees your files, your network and your environment; only resource limits "
                  "apply", file=sys.stderr, flush=True)
            _WARNED = True
        return "none"
    problem = isolation_problem(limits.python)
    if problem and POOL_DIR_NAME in problem:  # the isolation works; its uid pool's folder is not ours
        raise StareError(f"the tool sandbox cannot start calls ({problem})",
                         hint="remove that folder (another user may have made it) or set TMPDIR to a folder of "
                              "your own; the sandbox itself works here")
    if problem:
        namespaces = any(w in problem for w in ("unshare", "uid_map", "gid_map", "setgroups", "Operation not permitted"))
        fix = ("allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
               "kernel.unprivileged_userns_clone=1, or AppArmor's userns restriction off)" if namespaces else
               "the namespaces were created but the sandbox's root could not be built: check the path named above "
               "(rollout.tools.python picks another interpreter)")
        raise StareError(f"the tool sandbox cannot isolate calls on this machine ({problem})",
                         hint=f"{fix}, or, for code you trust only, rollout.tools.unsafe_no_isolation=true")
    global _WARNED_MEMORY
    if memory_cgroup_problem() and not _WARNED_MEMORY:
        print(f"warning: the tool sandbox limits memory per process only (address space, "
              f"{limits.memory_mb} MB each), not per call: {memory_cgroup_problem()} (run as root, or "
              "delegate a cgroup v2 memory controller, for a limit on the call as a whole)", file=sys.stderr)
        _WARNED_MEMORY = True
    missing = interpreter_info(limits.python)["missing"]
    if missing:
        print(f"warning: the sandbox interpreter lacks {', '.join(missing)}; set rollout.tools.python",
              file=sys.stderr)
    return "namespaces"


# ------------------------------------------------------------------------------------------ run
def run_python(code: str, limits: Limits = Limits()) -> Observation:
    """Run `code` with `python -I` in a fresh, isolated, limited process; return what it printed."""
    try:
        code.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: no interpreter can read it; say so, not a launcher traceback
        return Observation(f"the code is not valid text: {e.reason} at character {e.start} "
                           f"({code[e.start]!r}); nothing was run", -1, "error", 0.0,
                           "none" if limits.unsafe_no_isolation else "namespaces")
    if limits.unsafe_no_isolation:
        return _run_unisolated(code, limits)
    problem = isolation_problem(limits.python)
    if problem:  # fail closed: never run the code without isolation
        return Observation(f"sandbox unavailable: {problem}", -1, "error", 0.0, "namespaces")
    return _run_isolated(code, limits, interpreter_info(limits.python))


def _run_isolated(code: str, limits: Limits, info: dict) -> Observation:
    try:
        with _UidSlot() as slot, _CallCgroup(limits.memory_mb) as group:
            cfg = {"parent": os.getpid(), "host_uid": slot.uid, "python": info["exe"], "ro_paths": info["ro_paths"],
                   "cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "file_mb": limits.file_mb,
                   "nproc": limits.nproc, "code": code, "cgroup": str(group.path) if group.path else None}
            # The launcher's command line is what the call sees as PID 1's (/proc/1/cmdline: the call's
            # init is a fork of it): a neutral name and a bootstrap that reads the launcher's source from
            # stdin, so no host path (interpreter, checkout) is on it.
            source = INIT.read_bytes()
            obs = _supervise(LAUNCHER_ARGV, None, limits, "namespaces", None, executable=sys.executable,
                             stdin=b"%d\n" % len(source) + source + json.dumps(cfg).encode())
            peak, oom = group.finish()
            if oom:  # the kernel's OOM killer ended a process of the call (maybe not the first): say why
                # (its SIGKILL after cpu_s seconds read as a timeout before; the cgroup knows better)
                obs = dataclasses.replace(obs, output=obs.output + f"\n[a process was killed at the call's memory "
                                          f"limit of {limits.memory_mb} MB]",
                                          status="killed" if obs.status == "timeout" and obs.exit_code == -9
                                          else obs.status)
            return dataclasses.replace(obs, memory_peak_mb=peak)
    except OSError as e:
        return Observation(f"sandbox could not start: {e}", -1, "error", 0.0, "namespaces")


def _run_unisolated(code: str, limits: Limits) -> Observation:
    """The opt-out: a new session, resource limits, a throwaway working directory; nothing else."""
    require_isolation(limits)  # the warning
    work = tempfile.mkdtemp(prefix="stare-sbx-")

    def preexec() -> None:
        mb = 1024 * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    env = {"HOME": work, "TMPDIR": work, "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    try:
        return _supervise([limits.python or sys.executable, "-I", "-c", code], preexec, limits, "none", work, env)
    except OSError as e:
        return Observation(f"sandbox could not start: {e}", -1, "error", 0.0, "none")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _supervise(argv: list[str], preexec, limits: Limits, isolation: str, cwd: Optional[str],
               env: Optional[dict] = None, stdin: Optional[bytes] = None,
               executable: Optional[str] = None) -> Observation:
    """Start `argv` in a new session (`stdin`: bytes it reads first, from a pipe, then end of file),
    read its output up to the byte limit, kill its process group at the end or at the wall-clock
    limit, and turn the result into an Observation."""
    t0 = time.monotonic()
    status = "ok"
    proc = subprocess.Popen(argv, executable=executable, cwd=cwd, env=env if env is not None else {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec)
    if stdin is not None:  # from a thread: a large configuration must not block the output loop
        def feed() -> None:
            try:
                proc.stdin.write(stdin)
            except OSError:
                pass  # the launcher died early: its status says why
            finally:
                try:
                    proc.stdin.close()
                except OSError:
                    pass

        threading.Thread(target=feed, daemon=True).start()
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
            if len(out) >= limits.output_bytes:
                truncated = True
        if proc.poll() is not None and not chunk:
            break
        if time.monotonic() - t0 > limits.wall_s:
            status = "timeout"
            break
        if not chunk:
            time.sleep(0.005)
    try:  # the launcher's group; the namespace dies with it (parent-death signals, PID 1)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    code_ = proc.wait()
    proc.stdout.close()
    elapsed = time.monotonic() - t0
    text = out.decode("utf-8", errors="replace")
    if status == "ok":
        if code_ < 0:
            sig = -code_
            status = "timeout" if sig in (signal.SIGXCPU, signal.SIGKILL) and elapsed >= limits.cpu_s else "killed"
        elif code_ != 0:  # SETUP_FAILED with "sandbox setup failed: ..." when the launcher could not isolate
            status = "error"
        elif truncated:
            status = "output-truncated"
    if truncated:
        text += "\n[output truncated]"
    return Observation(text, code_, status, elapsed, isolation)
