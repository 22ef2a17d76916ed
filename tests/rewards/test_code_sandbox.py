"""The sandbox: hostile programs fail, are contained, and leave the test process unharmed."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from pathlib import Path

import pytest

from sparrow_nemo.rewards.code_sandbox import SandboxLimits, isolation, run_python

FAST = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=512, output_bytes=64 * 1024)


def _sandbox_dirs() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("sparrow_sandbox_")}


def test_plain_program_with_stdin_and_files() -> None:
    src = "n = int(input())\nopen('scratch.txt', 'w').write(str(n * 2))\nprint(open('scratch.txt').read())\n"
    r = run_python(src, "21\n", FAST)
    assert r.passed and r.returncode == 0 and r.stdout == "42\n" and not r.timed_out


@pytest.mark.parametrize(
    ("src", "exit_ok", "passed"),
    [
        ("import sys; sys.exit(0)", True, True),
        ("import sys; sys.exit(0)", False, False),  # tests that follow would be skipped
        ("raise SystemExit(3)", True, False),
        ("import os; os._exit(0)", True, False),  # exit status 0, but the guard never confirmed
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", True, False),
        ("assert 1 == 2", True, False),
    ],
)
def test_early_exits_do_not_pass(src: str, exit_ok: bool, passed: bool) -> None:
    assert run_python(src, "", FAST, exit_ok=exit_ok).passed is passed


def test_infinite_loop_hits_the_wall_clock() -> None:
    t0 = time.perf_counter()
    r = run_python("while True:\n    pass\n", "", SandboxLimits(wall_s=1.5, cpu_s=30))
    assert not r.passed and r.timed_out and r.returncode == -signal.SIGKILL
    assert time.perf_counter() - t0 < 10.0  # 1.5 s limit plus start-up on a shared CPU


def test_cpu_limit_kills_a_busy_loop() -> None:
    t0 = time.perf_counter()
    r = run_python("while True:\n    pass\n", "", SandboxLimits(wall_s=60, cpu_s=1))
    assert not r.passed and not r.timed_out
    assert r.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    assert time.perf_counter() - t0 < 30.0


def test_huge_output_is_capped() -> None:
    r = run_python("while True:\n    print('x' * 10000)\n", "", FAST)
    assert not r.passed and r.output_limited
    assert len(r.stdout.encode()) <= FAST.output_bytes


def test_memory_limit() -> None:
    r = run_python("x = bytearray(2 * 1024 ** 3)\nprint('allocated')\n", "", FAST)
    assert not r.passed and "MemoryError" in r.stderr and "allocated" not in r.stdout


@pytest.mark.parametrize(
    "src",
    [
        "import os\nwhile True:\n    os.fork()\n",
        "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n",
        "import multiprocessing as mp\nps = [mp.Process(target=print) for _ in range(100)]\n[p.start() for p in ps]\n",
        "import os\nos.system('sleep 100 &')\n",
    ],
)
def test_process_creation_is_refused(src: str) -> None:
    before = _sandbox_dirs()
    r = run_python(src, "", FAST)
    assert not r.passed and "not allowed" in r.stderr
    assert _sandbox_dirs() <= before  # its work directory is gone


def test_writing_outside_the_work_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "world_writable"
    shared.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(shared, 0o777)
    for src in (
        f"open({str(shared / 'a.txt')!r}, 'w').write('x')",
        f"import os\nos.close(os.open({str(shared / 'b.txt')!r}, os.O_CREAT | os.O_WRONLY))",
        "import os\nos.symlink('/etc/passwd', 'link')\nopen('link', 'a').write('x')",
        f"import os\nos.mkdir({str(shared / 'd')!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        "open('../escape.txt', 'w').write('x')",
    ):
        r = run_python(src, "", FAST)
        assert not r.passed, src
    assert sorted(os.listdir(shared)) == []
    assert shared.is_dir()


def test_network_is_unreachable() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        for src in (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n",
            f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\n",
            "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)\n",
        ):
            assert not run_python(src, "", FAST).passed, src
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody ever connected
    finally:
        listener.close()


def test_os_layers_when_available() -> None:
    """With root: a fresh network namespace (only loopback) and uid nobody, seen from inside."""
    iso = isolation()
    if not (iso["network_namespace"] and iso["drop_privileges"]):
        pytest.skip(f"OS isolation not available here: {iso}")
    src = (
        "import os\n"
        "names = sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:])\n"
        "print(os.getuid(), os.getgid(), names)\n"
    )
    r = run_python(src, "", FAST)
    assert r.passed, r.stderr
    assert r.stdout.split() == ["65534", "65534", "['lo']"]


def test_bad_limits() -> None:
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s=0)
