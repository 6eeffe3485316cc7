"""The tool sandbox's launcher: run as `stare-sandbox -I -S -c BOOTSTRAP < LENGTH SOURCE CONFIG_JSON` (the
interpreter under a neutral argv[0], this file's source on stdin: sandbox.LAUNCHER_ARGV; standard library
only, a fresh single-threaded process, as user namespaces require). benchmarks/generation/sandbox.py starts it;
read that module's docstring for what the sandbox guarantees. Processes:

  H (this script; dies with its parent: PR_SET_PDEATHSIG; joins the call's memory cgroup first,
     when the caller made one, so every process below is counted in it)
  └─ C  unshare(user, mount, pid, net, ipc, uts, cgroup); H writes C's uid/gid maps (the call's
        own uid from a pool when H is root, else the caller's uid), then C becomes root *of the
        namespace* and forks
     └─ G  PID 1 of the new PID namespace: builds a new root (read-only binds of the system and the
           interpreter, private tmpfs for /tmp, HOME, /dev/shm; no /proc), pivots into it, forks
        └─ P  limits (CPU, memory, file size, files, processes), every capability dropped and never
              regained (bounding set, securebits, no_new_privs), a session keyring of its own and a
              seccomp filter that refuses the keyring system calls, then execs the interpreter,
              which reads the code from a pipe (fd 3): the code is on no command line.
The configuration (code included) arrives on H's stdin, not in its arguments: `ps` shows no code.
When P exits, G exits, and the kernel kills everything left in the PID namespace (daemons too).
Each of H, C and G is killed when its parent dies, so killing H (the caller's wall-clock limit, or
the caller dying) ends the whole call. Exit statuses travel back up unchanged: a signal that killed
P kills C and H the same way.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
CLONE_NEWTIME = 0x00000080  # Linux 5.6: the boot and monotonic clocks (and sysinfo's uptime) of the call's own
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 47, 38
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
# Keyrings are not namespaced: a call could read the caller's session or user keyring, or plant keys
# there. Per architecture: (audit arch, add_key, request_key, keyctl).
KEY_SYSCALLS = {"x86_64": (0xC000003E, 248, 249, 250), "aarch64": (0xC00000B7, 217, 218, 219),
                "ppc64le": (0xC0000015, 269, 270, 271), "s390x": (0x80000016, 278, 279, 280)}
KEYCTL_JOIN_SESSION_KEYRING = 1
# Socket families are not all namespaced: AF_VSOCK (a VM's channel to its host) and others reach past the
# empty network namespace. Only AF_UNIX sockets may be created. Per architecture: socket, socketpair, and
# the calls whose arguments a filter cannot read (socketcall: its arguments are in memory; io_uring_setup:
# io_uring can open sockets by itself), which are refused outright (None: the architecture has none).
SOCKET_SYSCALLS = {"x86_64": (41, 53, None, 425), "aarch64": (198, 199, None, 425),
                   "ppc64le": (326, 333, 102, 425), "s390x": (359, 360, 102, 425)}
AF_UNIX = 1
# Where the low 32 bits of a call's first argument sit in struct seccomp_data (args[0] at offset 16).
ARG0_LOW = {"x86_64": 16, "aarch64": 16, "ppc64le": 16, "s390x": 20}
X32_SYSCALL_BIT = 0x40000000
# The interpreter's program: read the code from fd 3 (a pipe PID 1 fills), then run it as `-c` would.
LOADER = ("import os as _o\n"
          "def _r():\n"
          "    b = b''\n"
          "    while True:\n"
          "        c = _o.read(3, 1 << 16)\n"
          "        if not c:\n"
          "            return b\n"
          "        b += c\n"
          "_s = _r()\n_o.close(3)\ndel _r, _o\n"
          "exec(compile(_s, '<string>', 'exec'))\n")
SECURE_ALL = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80  # noroot, no_setuid_fixup, no ambient raise; locked
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "alternatives")
STAGE = b"/tmp"  # where the new root is assembled (inside the private mount namespace only)

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class SetupError(Exception):
    pass


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(e)}")


def _prctl(option: int, arg: int = 0, what: str = "prctl") -> None:
    _ok(libc.prctl(option, arg, 0, 0, 0), what)


def _die_with_parent(parent: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(137)


def _mount(src, dst, fstype, flags, data=None, what=None) -> None:
    enc = [x.encode() if isinstance(x, str) else x for x in (src, dst, fstype, data)]
    _ok(libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), what or f"mount {dst}")


def _locked_flags(path: str) -> int:
    """The flags of the mount holding `path` that a remount inside a user namespace must keep."""
    f = os.statvfs(path).f_flag
    out = 0
    for st, ms in ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME),
                   (2048, MS_NODIRATIME), (4096, MS_RELATIME)):
        if f & st:
            out |= ms
    return out


def _bind_ro(src: str, root: str, fd: int, is_dir: bool) -> None:
    """Bind `src` (file or directory, recursively) at the same path under `root`, read-only, and
    every mount below it read-only too. The source is an O_PATH descriptor H opened: the namespace's
    root (another uid when H is root) may not be allowed to look the path up (e.g. under /root)."""
    dst = root + src
    if is_dir:
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC, what=f"bind {src}")
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    for p in points:
        if p == dst or p.startswith(dst.rstrip("/") + "/"):
            flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(p)
            _mount(None, p, None, flags, what=f"read-only {p[len(root):]}")


def _build_root(cfg: dict) -> None:
    """The new root: system directories and the interpreter read-only, everything writable private."""
    root = STAGE.decode()
    mb = int(cfg["file_mb"])
    _mount(None, "/", None, MS_REC | MS_PRIVATE, what="make mounts private")
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755", what="new root")
    for d, target in cfg["links"]:
        os.symlink(target, root + d)
    os.makedirs(root + "/etc")
    with open(root + "/etc/passwd", "w") as f:
        f.write("sandbox:x:0:0:sandbox:/home/sandbox:/bin/false\n")
    with open(root + "/etc/group", "w") as f:
        f.write("sandbox:x:0:\n")
    with open(root + "/etc/hosts", "w") as f:
        f.write("127.0.0.1 localhost\n")
    # The private writable directories first, the read-only binds on top: an interpreter that lives
    # under /tmp (a virtual environment in a clone there) stays visible inside.
    for d, mode in (("/tmp", "1777"), ("/home/sandbox", "700"), ("/dev", "755")):
        os.makedirs(root + d, exist_ok=True)
        size = "64k" if d == "/dev" else f"{mb}m"
        _mount("tmpfs", root + d, "tmpfs", MS_NOSUID | MS_NODEV * (d != "/dev"), f"size={size},mode={mode}",
               what=f"tmpfs {d}")
    for path, fd, is_dir in cfg["binds"]:
        _bind_ro(path, root, fd, is_dir)
    for dev in DEVICES:
        open(f"{root}/dev/{dev}", "a").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND, what=f"bind /dev/{dev}")
    os.makedirs(root + "/dev/shm")
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={mb}m,mode=1777", what="tmpfs /dev/shm")
    # No /proc at all: a procfs of the call's own PID namespace still lists, per process, the mount table
    # (mountinfo: the host's block device, filesystem, bind sources and the tmpfs owner's host uid),
    # the uid map (the call's host uid), the environment and the memory map. Python, numpy, sympy,
    # subprocess, threads and multiprocessing need none of it (tests/test_sandbox.py). No /dev/fd or
    # /dev/std* either: they would point into /proc. cap_last_cap is read now, for _drop_everything.
    if os.path.exists("/proc/sys/kernel/cap_last_cap"):
        with open("/proc/sys/kernel/cap_last_cap") as f:
            cfg["cap_last_cap"] = int(f.read().strip())
    os.makedirs(root + "/.old")
    os.chdir(root)
    call = SYS_PIVOT_ROOT.get(platform.machine())
    if call is None:
        raise SetupError(f"pivot_root: unknown syscall number on {platform.machine()}")
    _ok(libc.syscall(call, b".", b".old"), "pivot_root")
    os.chdir("/")
    _ok(libc.umount2(b"/.old", MNT_DETACH), "detach the old root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, what="read-only root")
    os.chdir("/home/sandbox")


def _drop_everything(cfg: dict) -> None:
    """Limits, then no capability now or after exec (the code runs as uid 0 of its own namespace)."""
    mb = 1024 * 1024
    for res, soft, hard in ((resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1),
                            (resource.RLIMIT_AS, cfg["memory_mb"] * mb, cfg["memory_mb"] * mb),
                            (resource.RLIMIT_FSIZE, cfg["file_mb"] * mb, cfg["file_mb"] * mb),
                            (resource.RLIMIT_NOFILE, 64, 64), (resource.RLIMIT_CORE, 0, 0),
                            (resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"])):
        resource.setrlimit(res, (soft, hard))
    last = cfg.get("cap_last_cap", 40)  # read before the pivot (the call has no /proc)
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap, "drop capability")
    _prctl(PR_SET_SECUREBITS, SECURE_ALL, "securebits")
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "ambient capabilities")
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")


def _no_keyrings() -> None:
    """A new, empty session keyring, then a seccomp filter:
    - add_key, request_key and keyctl fail with EPERM (neither the caller's user keyring nor any other can
      be read or written);
    - socket and socketpair fail with EPERM for every address family but AF_UNIX (AF_INET/AF_INET6 have
      no route in the empty network namespace, but AF_VSOCK, AF_NETLINK and others are not namespaced);
      socketcall and io_uring_setup, whose socket requests a filter cannot see, fail outright;
    - any other architecture or ABI (i386, x32) of a system call is refused too.
    Fails closed: no filter, no call."""
    arch = platform.machine()
    if arch not in KEY_SYSCALLS or arch not in SOCKET_SYSCALLS:
        raise SetupError(f"seccomp: no system call numbers for {arch}")
    audit, add_key, request_key, keyctl = KEY_SYSCALLS[arch]
    sock, sockpair, socketcall, io_uring_setup = SOCKET_SYSCALLS[arch]
    libc.syscall(keyctl, KEYCTL_JOIN_SESSION_KEYRING, None)  # best effort: the filter is the guarantee
    refused = [n for n in (add_key, request_key, keyctl, socketcall, io_uring_setup) if n is not None]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW; SECCOMP_RET_ERRNO | EPERM
    # Built with labels: each jump names where it goes, and the offsets are computed below.
    code: list[tuple] = [
        ("ld", 4), ("jeq", audit, "nr", "DENY"),                 # another ABI: refused
        ("label", "nr"), ("ld", 0), ("jge", X32_SYSCALL_BIT, "DENY", None),  # x32 numbers: refused
        *[("jeq", n, "DENY", None) for n in refused],
        ("jeq", sock, "family", None), ("jeq", sockpair, "family", None),
        ("ret", allow),
        ("label", "family"), ("ld", ARG0_LOW[arch]), ("jeq", AF_UNIX, "ALLOW", "DENY"),
        ("label", "ALLOW"), ("ret", allow),
        ("label", "DENY"), ("ret", deny)]
    where, n = {}, 0
    for ins in code:
        if ins[0] == "label":
            where[ins[1]] = n
        else:
            n += 1
    prog, i = [], 0
    for ins in code:
        if ins[0] == "label":
            continue
        if ins[0] == "ld":
            prog.append((ld, 0, 0, ins[1]))
        elif ins[0] == "ret":
            prog.append((ret, 0, 0, ins[1]))
        else:  # a conditional jump: offsets count from the next instruction; None falls through
            op, k, t, f = ins
            off = lambda lab: 0 if lab is None else where[lab] - (i + 1)  # noqa: E731
            prog.append((jeq if op == "jeq" else jge, off(t), off(f), k))
        i += 1

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(prog))(*[SockFilter(*f) for f in prog])
    fprog = SockFprog(len(prog), filters)
    _ok(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp filter")


def _exit_like(status: int) -> None:
    """Leave the way a child with wait status `status` left: the same signal, or the same code."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 125)


def _start_clocks_at_zero() -> None:
    """Offsets of the new time namespace that start its CLOCK_BOOTTIME and CLOCK_MONOTONIC (and so the uptime
    `sysinfo` reports) near 0 for the call: the host's uptime, which tells how long the machine has run, is
    not visible. Written once, before any process enters the namespace (the kernel's rule)."""
    import time

    boot, mono = time.clock_gettime(time.CLOCK_BOOTTIME), time.clock_gettime(time.CLOCK_MONOTONIC)
    try:
        with open("/proc/self/timens_offsets", "w") as f:
            f.write(f"boottime {-int(boot)} 0\nmonotonic {-int(mono)} 0\n")
    except OSError as e:
        _fail(f"time namespace offsets: {e}")


def _fail(what: str) -> None:
    os.write(2, f"sandbox setup failed: {what}\n".encode())
    os._exit(125)


def _pid1(cfg: dict, status_w: int) -> None:
    """G: PID 1 of the call's namespace. Builds the root, runs P, reports P's wait status."""
    try:  # (C, the parent, is outside this PID namespace: getppid() is 0 here, so no check)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")
        _build_root(cfg)
        _ok(libc.sethostname(b"sandbox", 7), "sethostname")
    except (OSError, SetupError) as e:
        _fail(str(e))
    code_r, code_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(code_w)
            os.dup2(code_r, 3)  # inheritable: the interpreter reads the code there
            if code_r != 3:
                os.close(code_r)
            _drop_everything(cfg)
            _no_keyrings()
            env = {"HOME": "/home/sandbox", "TMPDIR": "/tmp", "PATH": "/usr/local/bin:/usr/bin:/bin",
                   "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8", "USER": "sandbox", "MPLBACKEND": "Agg"}
            os.execve(cfg["python"], [cfg["python"], "-I", "-c", LOADER], env)
        except (OSError, SetupError) as e:
            _fail(str(e))
    os.close(code_r)
    try:
        data = cfg["code"].encode()
        while data:
            data = data[os.write(code_w, data):]
    except OSError:
        pass  # the code's process died before reading it all: its status says why
    os.close(code_w)
    _, status = os.waitpid(pid, 0)
    os.write(status_w, status.to_bytes(4, "little"))
    os._exit(0)  # everything else in the namespace dies with PID 1


def _child(cfg: dict, parent: int, unshared_w: int, mapped_r: int) -> None:
    """C: new namespaces; once H has written the id maps, root of the namespace; forks G."""
    try:
        _die_with_parent(parent)
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
        own_clock = libc.unshare(flags | CLONE_NEWTIME) == 0
        if not own_clock:  # a kernel before 5.6: the same isolation, the host's boot clock still visible
            _ok(libc.unshare(flags), "unshare")
    except SetupError as e:
        _fail(str(e))
    os.write(unshared_w, b"u")
    if os.read(mapped_r, 1) != b"m":
        os._exit(125)
    if own_clock:  # before the namespace's first process, and before a change of credentials makes this
        _start_clocks_at_zero()  # process's /proc files root's: its boot and monotonic clocks start at the call
    try:  # still with the caller's host uid: paths it may look up (e.g. under /root) open here
        cfg = _open_sources(cfg)
    except OSError as e:
        _fail(f"open a read-only source: {e}")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    try:
        _die_with_parent(parent)  # a change of credentials clears the parent-death signal: set it again
    except SetupError as e:
        _fail(str(e))
    status_r, status_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(status_r)
        _pid1(cfg, status_w)
    os.close(status_w)
    data = os.read(status_r, 4)
    _, own = os.waitpid(pid, 0)
    if len(data) == 4:
        _exit_like(int.from_bytes(data, "little"))
    _exit_like(own)  # G itself failed (setup)


def _write_maps(pid: int, uid: int, gid: int) -> None:
    with open(f"/proc/{pid}/setgroups", "w") as f:
        f.write("deny")
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(f"0 {uid} 1\n")
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(f"0 {gid} 1\n")


def _open_sources(cfg: dict) -> dict:
    """Open every read-only source (system directories, a few /etc files, the interpreter's
    prefixes) as O_PATH descriptors, in C after unshare (a bind source must belong to the new mount
    namespace) and before C takes the namespace's uid (which may not look up e.g. /root); system
    symlinks (/bin -> usr/bin) are recreated as symlinks."""
    binds, links, seen = [], [], set()
    wanted = [*SYSTEM, *("/etc/" + n for n in ETC), *cfg["ro_paths"]]
    for path in wanted:
        if path in seen or not os.path.lexists(path):
            continue
        seen.add(path)
        if path in SYSTEM and os.path.islink(path):
            links.append((path, os.readlink(path)))
            continue
        if any(path != s and path.startswith(s + "/") for s in SYSTEM if s not in dict(links)):
            continue  # already inside a bound system directory
        fd = os.open(path, os.O_PATH)
        binds.append((path, fd, os.path.isdir(path)))
    return {**cfg, "binds": binds, "links": links}


def main() -> None:
    cfg = json.loads(sys.stdin.buffer.read())  # on stdin, never on a command line (`ps` would show it)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the code reads nothing of ours
    os.close(devnull)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        _die_with_parent(cfg["parent"])
    except SetupError as e:
        _fail(str(e))
    if cfg.get("cgroup"):  # the call's memory cgroup, joined before anything forks: every process is in it
        try:
            with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            _fail(f"join the call's memory cgroup {cfg['cgroup']}: {e}")
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(unshared_r)
        os.close(mapped_w)
        _child(cfg, me, unshared_w, mapped_r)
    os.close(unshared_w)
    os.close(mapped_r)
    if os.read(unshared_r, 1) == b"u":
        uid = cfg["host_uid"] if cfg["host_uid"] is not None else os.geteuid()
        gid = cfg["host_uid"] if cfg["host_uid"] is not None else os.getegid()
        try:
            _write_maps(pid, uid, gid)
            os.write(mapped_w, b"m")
        except OSError as e:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            _fail(f"user namespace id maps: {e}")
    _, status = os.waitpid(pid, 0)
    _exit_like(status)


if __name__ == "__main__":
    main()
