"""The sandbox runner: limits end a program, output is capped, stdin reaches it, bad limits are refused."""

from __future__ import annotations

import math
import signal
import time

import pytest

from sparrow_nemo.rewards.code_sandbox import SandboxLimits, run_python

#: wall clock wide enough for a sandbox start on a loaded machine; the other limits end hostile programs
FAST = SandboxLimits(wall_s=30.0, cpu_s=2, memory_mb=256, disk_mb=8, output_bytes=64 * 1024, max_processes=16)


def test_plain_program_with_stdin_and_files(sandbox: None) -> None:
    src = "n = int(input())\nopen('scratch.txt', 'w').write(str(n * 2))\nprint(open('scratch.txt').read())\n"
    r = run_python(src, "21\n", FAST)
    assert r.ok and r.returncode == 0 and r.stdout == "42\n" and r.failure is None


@pytest.mark.parametrize(
    ("src", "ok"),
    [
        ("import sys; sys.exit(0)", True),
        ("exit()", True),
        ("raise SystemExit(3)", False),
        ("import os; os._exit(4)", False),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", False),
        ("assert 1 == 2", False),
        ("print(", False),
    ],
)
def test_exit_status(sandbox: None, src: str, ok: bool) -> None:
    assert run_python(src, "", FAST).ok is ok


def test_infinite_sleep_hits_the_wall_clock(sandbox: None) -> None:
    t0 = time.monotonic()
    r = run_python("import time\ntime.sleep(100)\n", "", SandboxLimits(wall_s=1.5, cpu_s=30))
    assert not r.ok and r.failure == "timed out" and r.returncode is None
    assert time.monotonic() - t0 < 15.0  # 1.5 s limit plus start-up on a loaded CPU


def test_cpu_limit_kills_a_busy_loop(sandbox: None) -> None:
    r = run_python("while True:\n    pass\n", "", SandboxLimits(wall_s=60, cpu_s=1))
    assert not r.ok and r.failure is None
    assert r.returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL)
    assert r.wall_s < 30.0


def test_huge_output_is_capped(sandbox: None) -> None:
    r = run_python("while True:\n    print('x' * 10000)\n", "", FAST)
    assert not r.ok and r.failure == "output limit"
    assert len(r.stdout.encode()) <= FAST.output_bytes


def test_memory_of_one_process_and_of_all_together(sandbox: None) -> None:
    r = run_python("x = bytearray(2 * 1024 ** 3)\nprint('allocated')\n", "", FAST)
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout
    forks = (
        "import os, time\n"
        "for _ in range(4):\n"
        "    if os.fork() == 0:\n"
        "        b = bytearray(120 << 20)\n"
        "        time.sleep(30)\n"
        "time.sleep(30)\n"
    )
    r = run_python(forks, "", FAST)
    assert r.failure == "memory limit"


def test_work_folder_is_a_capped_tmpfs(sandbox: None) -> None:
    src = (
        "n = 0\n"
        "try:\n"
        "    for i in range(1000):\n"
        "        open(f'f{i}', 'wb').write(b'x' * 60000)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print(exc.errno, n)\n"
    )
    r = run_python(src, "", FAST)
    errno, written = map(int, r.stdout.split())
    assert errno == 28 and written * 60000 <= FAST.disk_mb << 20  # ENOSPC at the cap


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("wall_s", 0),
        ("wall_s", math.nan),
        ("wall_s", math.inf),
        ("wall_s", True),
        ("cpu_s", 1.5),
        ("memory_mb", 512.0),
        ("output_bytes", 1e6),
        ("disk_mb", -1),
        ("max_processes", "8"),
    ],
)
def test_bad_limits(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"'{field}' must be a"):
        SandboxLimits(**{field: value})
