"""The Python tool's sandbox: each hazard is contained with a clear observation and the caller goes on."""

from __future__ import annotations

import os

import pytest

from stare_cli.sandbox import Limits, run_python

L = Limits(cpu_s=2, wall_s=4, memory_mb=256, output_bytes=2048)


def test_plain_code_runs_and_prints():
    o = run_python("print(sum(range(10)))", L)
    assert (o.status, o.exit_code, o.text()) == ("ok", 0, "45")


def test_network_is_unreachable():
    o = run_python("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9', timeout=2)", L)
    assert o.status == "error"
    assert "Network is unreachable" in o.output or "network access is disabled" in o.output


@pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop needs root; as a user the OS permissions apply")
def test_writes_outside_the_work_directory_fail():
    o = run_python("open('/etc/stare_sandbox_probe', 'w').write('x')", L)
    assert o.status == "error" and "Permission denied" in o.output
    assert not os.path.exists("/etc/stare_sandbox_probe")


def test_work_directory_is_writable_and_thrown_away():
    o = run_python("import os\nopen('a.txt', 'w').write('x')\nprint(os.getcwd())", L)
    assert o.status == "ok"
    assert not os.path.exists(o.text())


def test_fork_bomb_is_contained():
    o = run_python("import os\nwhile True:\n    os.fork()", L)
    assert o.status in ("error", "killed", "timeout")
    assert o.elapsed_s < L.wall_s + 2


def test_infinite_loop_hits_the_cpu_limit():
    o = run_python("while True:\n    pass", L)
    assert o.status == "timeout" and "[timeout]" in o.text()


def test_sleeping_code_hits_the_wall_clock_limit():
    o = run_python("import time\ntime.sleep(60)", L)
    assert o.status == "timeout" and o.elapsed_s < L.wall_s + 2


def test_memory_bomb_is_contained():
    o = run_python("x = bytearray(4 * 1024**3)", L)
    assert o.status == "error" and "MemoryError" in o.output


def test_huge_output_is_truncated():
    o = run_python("print('a' * 10_000_000)", L)
    assert o.status == "output-truncated" and len(o.output) <= L.output_bytes + 30
    assert o.text().endswith("[output truncated]")


def test_exceptions_are_observations():
    o = run_python("1/0", L)
    assert o.status == "error" and "ZeroDivisionError" in o.text()


@pytest.mark.skipif(os.geteuid() != 0, reason="private mounts need root")
def test_world_writable_dirs_are_private():
    probe = f"/tmp/stare_sandbox_probe_{os.getpid()}"
    o = run_python(f"open({probe!r}, 'w').write('x')\nprint('wrote')", L)
    assert o.isolation == "netns+tmpfs"
    assert o.status == "ok" and not os.path.exists(probe)  # written into the call's private /tmp only
