"""Start a harness in the OS sandbox (:mod:`sparrow_nemo.rewards.sandbox_os`), talk to it, and make it go.

A :class:`SandboxProcess` is one bubblewrap sandbox running a harness of this package
(:mod:`~sparrow_nemo.rewards._sandbox_program` for model code, :mod:`~sparrow_nemo.rewards._sandbox_checker`
for tests) under :class:`SandboxLimits`. Its caps, and who enforces them:

- wall clock (``wall_s``): the trainer kills the sandbox at its deadline;
- memory of the whole program (``memory_mb``): a thread of the trainer sums the resident memory (anonymous +
  shared) of every process of every live sandbox every few milliseconds and kills a sandbox past its cap
  (:mod:`~sparrow_nemo.rewards.sandbox_memory`); the kernel caps each process (``RLIMIT_AS``) and the seccomp
  filter denies the memory no resident size shows; the work folder's tmpfs is capped separately
  (``disk_mb``);
- processes (``max_processes``): ``RLIMIT_NPROC``, which the kernel counts per user namespace, so it caps
  this sandbox's processes only; CPU seconds (``cpu_s``): ``RLIMIT_CPU`` per process;
- output (``output_bytes``): stdout, every reply line and the total written to stderr (where a served
  program's prints go) are read with that cap (the sandbox is killed past it); ``RLIMIT_FSIZE`` caps each
  file written;
- lifetime: killing the sandbox kills bwrap, whose PID-namespace init dies with it (``--die-with-parent``),
  and the kernel then kills every process left in that namespace; :meth:`SandboxProcess.close` returns only
  once that init is gone (a pidfd on it), so no process of the program outlives the reward.

:func:`run_python` runs a stdin/stdout program this way. ``unsafe=True`` (the recipe's
``reward.options.sandbox=unsafe_local``) runs the same harness as a plain child process with only the
rlimits and a process-group kill: no isolation at all.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sparrow_nemo.rewards import sandbox_wire as wire
from sparrow_nemo.rewards.sandbox_memory import WATCH
from sparrow_nemo.rewards.sandbox_os import (
    SANDBOX_DIR,
    bwrap_command,
    memory_file,
    popen_user_args,
    require,
    seccomp_file,
)

_HERE = Path(__file__).parent
#: longest wait for a pipe before the loops look at the clock and at a failure set by the memory watch
_WAKE_S = 0.05
#: stderr kept for diagnostics (the rest is read and dropped)
_STDERR_KEEP = 64 * 1024
#: how long a killed sandbox may take to vanish before that is an error
_REAP_S = 30.0


#: the largest value a test spec may give each limit: a data row cannot lift the caps (``wall_s: 1e12``)
LIMIT_MAXIMA = {
    "wall_s": 600.0,
    "cpu_s": 600,
    "memory_mb": 16384,
    "disk_mb": 4096,
    "output_bytes": 64 << 20,
    "max_processes": 1024,
}


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed program (all positive and at most their :data:`LIMIT_MAXIMA`; all but
    ``wall_s`` integers).

    Attributes:
        wall_s: wall-clock seconds (per test case) before the sandbox is killed.
        cpu_s: CPU seconds per process (RLIMIT_CPU).
        memory_mb: MiB of resident memory of all the program's processes together (and RLIMIT_AS of each).
        disk_mb: MiB of the private work folder (a tmpfs), the only writable place.
        output_bytes: cap on stdout, on each reply line and on any file written (RLIMIT_FSIZE).
        max_processes: processes of the sandbox, its init and harness included (RLIMIT_NPROC).
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 1024
    disk_mb: int = 64
    output_bytes: int = 1 << 20
    max_processes: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            integer = name != "wall_s"
            ok_type = type(value) is int or (not integer and type(value) is float)
            top = LIMIT_MAXIMA[name]
            if not ok_type or not math.isfinite(value) or not 0 < value <= top:
                kind = "a positive integer" if integer else "a positive number of seconds"
                raise ValueError(f"code sandbox limit '{name}' must be {kind} up to {top}, got {value!r}")


class SandboxProcess:
    """One harness running in a sandbox, with its stdin, stdout and stderr in the trainer's hands.

    Args:
        harness: the harness file of this package, e.g. ``"_sandbox_program.py"``.
        args: its command-line arguments.
        limits: the caps (see the module docstring).
        files: ``{name: content}`` shown read-only next to the harness (e.g. ``program.py``).
        stdin: the program's whole standard input; None = a pipe for :meth:`send`.
        unsafe: no isolation (a plain child process; the recipe must have asked for it).

    Raises:
        SandboxUnavailable: OS isolation is missing here and ``unsafe`` is False.
    """

    def __init__(
        self,
        harness: str,
        args: list[str],
        limits: SandboxLimits,
        files: dict[str, bytes],
        stdin: bytes | None = None,
        unsafe: bool = False,
    ) -> None:
        self.limits = limits
        self.failure: str | None = None  # why the sandbox was stopped, when it was
        self.stdout = b""
        self._stderr = bytearray()
        self._stderr_total = 0  # bytes read from stderr so far (only the first _STDERR_KEEP are kept)
        self._pending = b""
        self._tmp: Path | None = None
        self._init_pidfd: int | None = None
        self._watch_key = next(_watch_keys)
        contents = _harness_files() | files
        stdin_fd = memory_file("stdin", stdin) if stdin is not None else subprocess.PIPE
        keep: list[int] = []
        try:
            if unsafe:
                self._tmp = Path(tempfile.mkdtemp(prefix="sparrow_unsafe_"))
                (self._tmp / "work").mkdir()
                for name, data in contents.items():
                    (self._tmp / name).write_bytes(data)
                cmd = [sys.executable, "-I", "-S", str(self._tmp / harness), *args]
                popen = {"cwd": self._tmp / "work", "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}}
            else:
                iso = require()
                fds = {name: memory_file(name, data) for name, data in contents.items()}
                keep += fds.values()
                seccomp = seccomp_file()
                info_r, info_w = os.pipe()
                keep += [seccomp, info_w]
                argv = [iso.python, "-I", "-S", f"{SANDBOX_DIR}/{harness}", *args]
                disk = limits.disk_mb << 20
                cmd = bwrap_command(iso, argv, disk, fds, seccomp, info_fd=info_w)
                # bwrap's own environment is the PID-namespace init's, which the program can read in /proc/1:
                # it gets none of the trainer's (tokens, paths)
                popen = {"cwd": "/", "env": {"PATH": "/usr/bin:/bin"}, **popen_user_args(iso.run_as)}
            self.proc = subprocess.Popen(
                cmd,
                stdin=stdin_fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=keep,
                start_new_session=True,
                **popen,
            )
        finally:
            for fd in keep + ([stdin_fd] if isinstance(stdin_fd, int) and stdin_fd >= 0 else []):
                os.close(fd)
        if not unsafe:
            self._init_pidfd = _init_pidfd(info_r, self.proc.pid)
        self._exit_fd = os.pidfd_open(self.proc.pid)
        WATCH.watch(self._watch_key, self.proc.pid, limits.memory_mb << 20, self._over_memory)
        for pipe in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if pipe is not None:
                os.set_blocking(pipe.fileno(), False)

    # ---- talking to it -------------------------------------------------------------------------------
    def send(self, message: dict) -> None:
        """Queue ``message`` for the harness's stdin (written while :meth:`receive` waits)."""
        self._pending += wire.dumps(message)

    def receive(self, deadline: float, cap: int) -> dict | None:
        """The next message line (at most ``cap`` bytes) from the harness's stdout, by ``deadline``
        (``time.monotonic()``).

        None when there is none: the sandbox then is stopped and :attr:`failure` says why ("timed out",
        "exited", "memory limit", "output limit", "bad message: ...").
        """
        while self.failure is None:
            newline = self.stdout.find(b"\n")
            if newline >= 0:
                line, self.stdout = self.stdout[:newline], self.stdout[newline + 1 :]
                try:
                    return wire.loads(line)
                except wire.WireError as exc:
                    self.stop(f"bad message: {exc}")
            elif len(self.stdout) > cap or self._stderr_total > self.limits.output_bytes:
                self.stop("output limit")
            elif self.proc.stdout.closed:
                self.stop("exited")
            elif time.monotonic() >= deadline:
                self.stop("timed out")
            else:
                self._pump(deadline)
        return None

    def wait(self, deadline: float) -> bool:
        """Collect stdout until the program has exited and closed its output (True), or it is stopped at a
        limit (False; :attr:`failure` says which)."""
        while self.failure is None:
            if max(len(self.stdout), self._stderr_total) > self.limits.output_bytes:
                self.stop("output limit")
            elif self.proc.returncode is not None and self.proc.stdout.closed and self.proc.stderr.closed:
                break
            elif time.monotonic() >= deadline:
                self.stop("timed out")
            else:
                self._pump(deadline)
        return self.failure is None

    @property
    def stderr(self) -> str:
        """What the harness wrote to stderr (the first 64 KiB), decoded."""
        return self._stderr.decode("utf-8", errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def _pump(self, deadline: float) -> None:
        """Wait (until ``deadline``, at most ``_WAKE_S``) and move what is ready between the pipes."""
        readers: list = [p for p in (self.proc.stdout, self.proc.stderr) if not p.closed]
        if self.proc.returncode is None:
            readers.append(self._exit_fd)  # wakes up when the sandbox exits
        writers = [self.proc.stdin] if self._pending else []
        timeout = min(max(0.0, deadline - time.monotonic()), _WAKE_S)
        ready_r, ready_w, _ = select.select(readers, writers, [], timeout)
        for pipe in ready_r:
            if pipe is self._exit_fd:  # exited: reaped once the memory watch lets go of its pid
                WATCH.unwatch(self._watch_key)
                self.proc.poll()
                continue
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                pipe.close()
            elif pipe is self.proc.stdout:
                self.stdout += chunk
            else:
                self._stderr_total += len(chunk)
                if len(self._stderr) < _STDERR_KEEP:
                    self._stderr += chunk[: _STDERR_KEEP - len(self._stderr)]
        if ready_w:
            try:
                written = os.write(self.proc.stdin.fileno(), self._pending[: 1 << 16])
                self._pending = self._pending[written:]
            except BrokenPipeError:
                self._pending = b""

    def _over_memory(self) -> None:
        """The memory watch's thread: record the limit and kill the sandbox (:meth:`close` reaps it). The
        pid is not reaped while watched, and the pidfd is closed only after :meth:`close` unwatches."""
        if self.failure is None:
            self.failure = "memory limit"
        with contextlib.suppress(ProcessLookupError):
            if self._tmp is not None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                for fd in (self._exit_fd, self._init_pidfd):  # bwrap, and its init at once
                    if fd is not None:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)

    # ---- ending it -----------------------------------------------------------------------------------
    def stop(self, why: str) -> None:
        """Record ``why`` and kill the sandbox (every process in it)."""
        if self.failure is None:
            self.failure = why
        self.close()

    def close(self) -> None:
        """Kill whatever still runs and return once every process of the sandbox is gone.

        Raises:
            RuntimeError: a sandbox process survived ``_REAP_S`` seconds after the kill (never expected).
        """
        WATCH.unwatch(self._watch_key)
        if self.proc.returncode is None:
            try:
                if self._tmp is not None:
                    os.killpg(self.proc.pid, signal.SIGKILL)  # unsafe mode: the process group
                else:
                    self.proc.kill()  # bwrap; its init and so the whole PID namespace die with it
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self._init_pidfd is not None:  # do not rely on --die-with-parent's timing alone
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
        survived = self._init_pidfd is not None and not _wait_readable(
            self._init_pidfd, time.monotonic() + _REAP_S
        )
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
        for fd in (self._init_pidfd, self._exit_fd):
            if fd is not None:
                os.close(fd)
        self._init_pidfd = self._exit_fd = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if survived:
            raise RuntimeError("code sandbox: a process of the sandbox survived its kill")

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_watch_keys = itertools.count()  # next() is atomic under the GIL: safe across reward threads


@functools.cache
def _harness_files() -> dict[str, bytes]:
    """The files of this package every harness needs next to it (read once)."""
    names = ("sandbox_wire.py", "_sandbox_program.py", "_sandbox_checker.py")
    return {name: (_HERE / name).read_bytes() for name in names}


def _init_pidfd(info_r: int, bwrap_pid: int) -> int | None:
    """pidfd of the sandbox's PID-namespace init, from bwrap's ``--info-fd`` JSON (None: already gone).

    The pid is read some time after bwrap wrote it: if the init has exited, its number may already belong to
    another process (pid_max is often 32,768), so the pidfd is kept only if that process's parent is
    ``bwrap_pid``. A pidfd, once checked, cannot be recycled: killing through it is safe.
    """
    with os.fdopen(info_r, "rb") as fh:
        text = fh.read()
    try:
        pid = int(wire.loads(text.replace(b"\n", b" "))["child-pid"])
        fd = os.pidfd_open(pid)
    except (wire.WireError, KeyError, ValueError, ProcessLookupError):
        return None  # bwrap failed before starting it, or it has exited already
    if _parent_pid(pid) != bwrap_pid:
        os.close(fd)
        return None  # the init is gone and its number reused
    return fd


def _parent_pid(pid: int) -> int | None:
    """PPid of ``pid`` from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"PPid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _wait_readable(fd: int, deadline: float) -> bool:
    """Whether ``fd`` becomes readable (a pidfd: its process exited) before ``deadline``."""
    ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    return bool(ready)


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one stdin/stdout run.

    Attributes:
        returncode: exit status of the program (bwrap passes it through); negative = killed by that
            signal; None when it was stopped at a limit.
        stdout: its standard output (UTF-8, errors replaced), at most ``output_bytes``.
        stderr: the first 64 KiB of its standard error.
        failure: the limit it was stopped at ("timed out", "memory limit", "output limit"), else None.
        wall_s: seconds the run took.
    """

    returncode: int | None
    stdout: str
    stderr: str
    failure: str | None
    wall_s: float

    @property
    def ok(self) -> bool:
        """It ran to the end within its limits and exited with status 0."""
        return self.failure is None and self.returncode == 0


def run_python(
    source: str, stdin: str = "", limits: SandboxLimits | None = None, unsafe: bool = False
) -> SandboxResult:
    """Run ``source`` (a whole Python program) with ``stdin`` as its standard input, in the sandbox."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    with SandboxProcess(
        "_sandbox_program.py",
        ["stdio", limits_json(limits)],
        limits,
        {"program.py": source.encode("utf-8", errors="surrogatepass")},
        stdin=stdin.encode("utf-8", errors="surrogatepass"),
        unsafe=unsafe,
    ) as box:
        box.wait(start + limits.wall_s)
        box.close()
        out = box.stdout[: limits.output_bytes].decode("utf-8", errors="replace")
        code = None if box.failure else box.returncode
        return SandboxResult(code, out, box.stderr, box.failure, time.monotonic() - start)


def limits_json(limits: SandboxLimits) -> str:
    """The harnesses' rlimits, as their JSON command-line argument."""
    return (
        wire.dumps(
            {
                "cpu_s": limits.cpu_s,
                "memory_bytes": limits.memory_mb << 20,
                "file_bytes": limits.output_bytes,
                "processes": limits.max_processes,
            }
        )
        .decode()
        .strip()
    )
