"""Run an untrusted Python program in a sandboxed subprocess and report what happened.

Isolation, strongest available first (see :func:`isolation`):

- a fresh network namespace (``unshare -n``, needs root / CAP_SYS_ADMIN): no network at all;
- privileges dropped to ``nobody`` (as root, when the interpreter's standard library is readable by others):
  the program cannot write root's files, and ``RLIMIT_NPROC`` is enforced (it is not for root);
- resource limits: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), written file size
  (``RLIMIT_FSIZE``, which also caps stdout/stderr since they go to files), processes, open files, no core;
- a wall-clock limit; the program runs in its own session and the whole process group is killed after it;
- an audit hook in the child (always on; :mod:`sparrow_nemo.rewards._sandbox_guard`): no process creation,
  sockets, ctypes, signals or writes outside the work directory;
- a fresh temporary work directory, removed afterwards.

Audit hooks are not a security boundary against a determined attacker (C extensions can bypass them); with
root the namespace, uid and rlimits are the real walls, without root the hook is what blocks sockets and
writes. A run passes only when the guard reports that the whole program ran (see the guard's docstring).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_GUARD = Path(__file__).with_name("_sandbox_guard.py")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Attributes:
        wall_s: wall-clock seconds before the process group is killed.
        cpu_s: CPU seconds (RLIMIT_CPU; whole seconds).
        memory_mb: address-space limit in MiB (RLIMIT_AS).
        output_bytes: cap on each of stdout and stderr, and on any file the program writes (RLIMIT_FSIZE).
        max_processes: RLIMIT_NPROC for the sandbox user (enforced only after dropping root).
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 1024
    output_bytes: int = 1 << 20
    max_processes: int = 64

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "output_bytes", "max_processes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run.

    Attributes:
        passed: the program ran to the end without an uncaught exception (and, unless ``exit_ok``, without
            ``sys.exit``), and the guard confirmed it.
        returncode: exit status; negative = killed by that signal.
        stdout / stderr: decoded output (UTF-8, errors replaced), at most ``output_bytes`` each.
        timed_out: the wall-clock limit was hit.
        output_limited: an output or a written file reached ``output_bytes`` (the program was killed).
        wall_s: seconds the run took.
    """

    passed: bool
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    output_limited: bool
    wall_s: float


@functools.cache
def _netns_available() -> bool:
    """True when ``unshare -n`` works here (root with CAP_SYS_ADMIN and util-linux installed)."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        return False
    probe = subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=10, check=False)
    return probe.returncode == 0


def _readable_by_others(path: Path) -> bool:
    """Every directory from / to ``path`` is searchable by others and ``path`` is readable by others."""
    path = path.resolve()
    for part in [*reversed(path.parents), path]:
        mode = part.stat().st_mode
        if not mode & 0o001 or (part == path and not mode & 0o004):
            return False
    return True


@functools.cache
def _sandbox_python() -> tuple[str, bool]:
    """(interpreter, can drop to nobody): this interpreter if ``nobody`` can read its standard library,
    else the system ``python3`` of the same minor version if nobody can; else this one without dropping."""
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return sys.executable, False
    if os.geteuid() != 0:
        return sys.executable, False
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"]
    for exe in candidates:
        if not os.access(exe, os.X_OK):
            continue
        probe = subprocess.run(
            [exe, "-I", "-S", "-c", "import os; print(os.path.dirname(os.__file__))"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        stdlib = Path(probe.stdout.strip())
        if probe.returncode == 0 and _readable_by_others(stdlib) and _readable_by_others(Path(exe)):
            return exe, True
    return sys.executable, False


def isolation() -> dict[str, bool | str]:
    """Which isolation layers this machine gives (for logs and the tests)."""
    exe, drops = _sandbox_python()
    return {
        "network_namespace": _netns_available(),
        "drop_privileges": drops,
        "python": exe,
        "audit_hook": True,
    }


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    """(text of at most ``cap`` bytes, whether the file reached the cap: RLIMIT_FSIZE stops it there)."""
    with open(path, "rb") as fh:
        data = fh.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) >= cap


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _write_config(
    private: Path, workdir: Path, limits: SandboxLimits, marker_fd: int, token: str, exit_ok: bool, drop: bool
) -> Path:
    """Write the guard's config (root-only readable when ``drop``) and hand the work directory to nobody."""
    nobody = pwd.getpwnam("nobody") if drop else None
    if nobody is not None:  # private/ stays root's (0711: nobody may pass through, not list or write)
        os.chmod(private, 0o711)
        for p in (workdir, workdir / "program.py"):
            os.chown(p, nobody.pw_uid, nobody.pw_gid)
    config = private / "config.json"
    fields = {
        "workdir": str(workdir),
        "program": str(workdir / "program.py"),
        "cpu_s": int(limits.cpu_s),
        "memory_bytes": limits.memory_mb << 20,
        "file_size_bytes": limits.output_bytes,
        "max_processes": limits.max_processes,
        "uid": nobody.pw_uid if nobody else None,
        "gid": nobody.pw_gid if nobody else None,
        "marker_fd": marker_fd,
        "token": token,
        "exit_ok": exit_ok,
    }
    config.write_text(json.dumps(fields))
    os.chmod(config, 0o600)
    return config


def _command(exe: str, config: Path) -> list[str]:
    cmd = [exe, "-I", "-S", str(_GUARD), str(config)]
    return [shutil.which("unshare") or "unshare", "-n", "--", *cmd] if _netns_available() else cmd


def _read_marker(fd: int) -> bytes:
    """What the guard wrote to the marker pipe (nothing if it never did), without blocking."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 64)
    except BlockingIOError:
        return b""


def run_python(
    source: str, stdin: str = "", limits: SandboxLimits | None = None, exit_ok: bool = True
) -> SandboxResult:
    """Run ``source`` (a whole Python program) with ``stdin`` as its standard input, inside the sandbox.

    ``exit_ok``: whether ``sys.exit(0)`` / ``exit()`` counts as passing (True for stdin/stdout programs;
    False when tests follow the solution in the same program, so that exiting early cannot skip them).
    """
    limits = limits or SandboxLimits()
    exe, drop = _sandbox_python()
    private = Path(tempfile.mkdtemp(prefix="sparrow_sandbox_"))  # config and outputs; the program is in work/
    workdir = private / "work"
    workdir.mkdir(mode=0o700)
    read_fd, write_fd = os.pipe()
    token = secrets.token_hex(16)
    try:
        (workdir / "program.py").write_text(source, encoding="utf-8")
        (private / "stdin").write_text(stdin, encoding="utf-8")
        config = _write_config(private, workdir, limits, write_fd, token, exit_ok, drop)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "HOME": str(workdir)}
        start = time.perf_counter()
        with (
            open(private / "stdin", "rb") as fin,
            open(private / "stdout", "wb") as fout,
            open(private / "stderr", "wb") as ferr,
        ):
            proc = subprocess.Popen(
                _command(exe, config),
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                cwd=workdir,
                env=env,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        os.close(write_fd)
        write_fd = -1
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)  # the program and anything it left behind in its process group
        proc.wait()
        wall = time.perf_counter() - start
        marker = _read_marker(read_fd)
        stdout, out_capped = _read_capped(private / "stdout", limits.output_bytes)
        stderr, err_capped = _read_capped(private / "stderr", limits.output_bytes)
        limited = out_capped or err_capped or proc.returncode == -signal.SIGXFSZ
        passed = marker == token.encode() and not timed_out and not limited and proc.returncode == 0
        return SandboxResult(passed, proc.returncode, stdout, stderr, timed_out, limited, wall)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        shutil.rmtree(private, ignore_errors=True)
