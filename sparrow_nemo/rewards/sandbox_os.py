"""What the operating system gives the code sandbox here, and the bubblewrap command that uses it.

Every sandboxed program runs under ``bwrap`` (bubblewrap) in fresh user, PID, mount, network, IPC, UTS and
cgroup namespaces, started as an unprivileged user: the trainer's own uid, or ``nobody`` when the trainer
is root (so that even the kernel's uid outside the namespace is not root's). Inside it sees only:

- ``/usr`` (and the ``/bin``, ``/lib*``, ``/sbin`` links or folders of the host) and, for an interpreter
  installed elsewhere, that interpreter's prefix, all read-only;
- ``/sandbox``: the harness files and the program, read-only copies written by bwrap from memory;
- ``/work``: an empty tmpfs of ``disk_mb`` MiB, the only writable place (also its home and cwd);
- its own ``/proc`` (only its own processes), a minimal read-only ``/dev`` (null, zero, random, tty...).

Nothing else of the host exists there: no ``/tmp``, ``/etc``, ``/run``, ``/dev/shm``, ``/home``, no host
socket (abstract Unix sockets belong to the network namespace), no training data. bwrap drops every
capability, forbids new user namespaces inside (``--disable-userns``), starts the program in a new
session, and kills it when its parent dies (``--die-with-parent``); the PID namespace's init takes every
descendant with it. A seccomp filter (:mod:`sparrow_nemo.rewards.sandbox_seccomp`) denies the keyrings,
System V IPC, non-Unix sockets, memfds, io_uring, userfaultfd and ptrace.

:func:`probe` checks once per trainer uid that this actually works, by starting a sandbox; when it does
not, :attr:`Isolation.missing` says what is missing and the code reward refuses to run (unless the recipe
opts into ``reward.options.sandbox=unsafe_local``).
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass

from sparrow_nemo.rewards.sandbox_seccomp import seccomp_program

#: where the harness files and the program appear inside the sandbox
SANDBOX_DIR = "/sandbox"
#: the sandbox's only writable folder (a size-capped tmpfs)
WORK_DIR = "/work"
_HOST_TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class SandboxUnavailable(ValueError):
    """OS isolation cannot be had on this machine (the message says what is missing). A ValueError: like a
    bad recipe value, the CLI reports it as one line with exit status 2."""


@dataclass(frozen=True)
class Isolation:
    """What a sandbox is built from here.

    Attributes:
        bwrap: the bubblewrap executable, or None when not installed.
        run_as: uid bwrap runs as (None: the trainer's own; ``nobody``'s when the trainer is root).
        python: the interpreter the sandbox runs (the standard library is all a program gets).
        binds: host folders bound read-only at the same path (``/usr`` plus the interpreter's prefix).
        missing: why the sandbox cannot be built (None when it can).
    """

    bwrap: str | None
    run_as: int | None
    python: str | None
    binds: tuple[str, ...]
    missing: str | None

    @property
    def available(self) -> bool:
        return self.missing is None


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def popen_user_args(run_as: int | None) -> dict:
    """``subprocess.Popen`` keyword arguments that start the sandbox as ``run_as`` (nothing when None)."""
    if run_as is None:
        return {}
    uid, gid = _nobody()
    return {"user": uid, "group": gid, "extra_groups": []}


def _host_layout() -> list[str]:
    """bwrap arguments recreating the host's top-level ``/bin``/``/lib*``/``/sbin`` (links or folders)."""
    args: list[str] = []
    for top in _HOST_TOP_DIRS:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def memory_file(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, positioned at its start, inheritable (for bwrap)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)  # memfds take the whole write
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    return fd


def bwrap_command(
    iso: Isolation,
    argv: list[str],
    disk_bytes: int,
    files: dict[str, int],
    seccomp_fd: int,
    info_fd: int | None = None,
) -> list[str]:
    """The bwrap command line running ``argv`` in the sandbox.

    Args:
        argv: the command inside (its paths are sandbox paths).
        disk_bytes: size of the ``/work`` tmpfs.
        files: ``{name: fd}``: each fd's content (read to EOF by bwrap) appears read-only as
            ``/sandbox/<name>``.
        seccomp_fd: a :func:`memory_file` of :func:`~sparrow_nemo.rewards.sandbox_seccomp.seccomp_program`.
        info_fd: bwrap writes ``{"child-pid": <host pid of the namespace's init>, ...}`` there.
    """
    if not iso.available:
        raise SandboxUnavailable(iso.missing)
    cmd = [iso.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    cmd += ["--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]
    for path in iso.binds:
        cmd += ["--ro-bind", path, path]
    cmd += _host_layout()
    for name, fd in files.items():
        cmd += ["--ro-bind-data", str(fd), f"{SANDBOX_DIR}/{name}"]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(disk_bytes), "--tmpfs", WORK_DIR]
    cmd += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR, "--clearenv"]
    env = {"PATH": "/usr/bin:/bin", "HOME": WORK_DIR, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    cmd += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        cmd += ["--info-fd", str(info_fd)]
    return [*cmd, "--", *argv]


def seccomp_file() -> int:
    """A :func:`memory_file` holding this machine's seccomp filter (the caller closes it)."""
    program = seccomp_program()
    if program is None:  # probe() refuses such a machine first
        raise SandboxUnavailable(f"no seccomp filter for this machine ({os.uname().machine})")
    return memory_file("seccomp", program)


def _python_prefix(exe: str) -> str | None:
    """``sys.base_prefix`` of the interpreter ``exe`` (None when it does not run)."""
    if os.path.realpath(exe) == os.path.realpath(sys.executable):
        return sys.base_prefix
    try:
        out = subprocess.run(
            [exe, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _candidates() -> list[str]:
    """Interpreters to try, this one first, then the system's of the same version, then any python3."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    names = [os.path.realpath(sys.executable)]
    for name in (f"/usr/bin/{version}", f"/usr/local/bin/{version}", "/usr/bin/python3"):
        if os.access(name, os.X_OK) and os.path.realpath(name) not in names:
            names.append(os.path.realpath(name))
    return names


def _binds_for(exe: str) -> tuple[str, ...] | None:
    prefix = _python_prefix(exe)
    if prefix is None:
        return None
    binds = ["/usr"]
    for path in (prefix, os.path.dirname(exe)):
        real = os.path.realpath(path)
        if real != "/usr" and not real.startswith("/usr/") and real not in binds:
            binds.append(real)
    return tuple(binds)


def _try(bwrap: str, run_as: int | None, exe: str, binds: tuple[str, ...]) -> str | None:
    """None when a sandbox running ``exe`` starts and works; else bwrap's (or python's) last error line."""
    iso = Isolation(bwrap, run_as, exe, binds, None)
    probe = "import os; os.listdir('/work'); print('ok')"
    seccomp = seccomp_file()
    cmd = bwrap_command(iso, [exe, "-I", "-S", "-c", probe], 1 << 20, {}, seccomp)
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            pass_fds=[seccomp],
            **popen_user_args(run_as),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        os.close(seccomp)
    if out.returncode == 0 and out.stdout.strip() == "ok":
        return None
    lines = (out.stderr or out.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {out.returncode}"


@functools.cache
def _probe(euid: int) -> Isolation:
    bwrap = shutil.which("bwrap")
    run_as = _nobody()[0] if euid == 0 else None
    if bwrap is None:
        return Isolation(
            None,
            run_as,
            None,
            (),
            "bubblewrap is not installed (no 'bwrap' on PATH; apt-get install bubblewrap)",
        )
    if seccomp_program() is None:
        return Isolation(
            bwrap, run_as, None, (), f"no seccomp filter for this machine ({os.uname().machine})"
        )
    errors = []
    for exe in _candidates():
        binds = _binds_for(exe)
        if binds is None:
            errors.append(f"{exe} does not run")
            continue
        error = _try(bwrap, run_as, exe, binds)
        if error is None:
            return Isolation(bwrap, run_as, exe, binds, None)
        errors.append(f"{exe}: {error}")
    who = "uid nobody" if run_as is not None else f"uid {euid}"
    return Isolation(
        bwrap,
        run_as,
        None,
        (),
        f"bwrap cannot start a sandbox as {who} (unprivileged user namespaces disabled, or no Python "
        f"interpreter that {who} can read): {'; '.join(errors)}",
    )


def probe() -> Isolation:
    """The isolation this machine gives a trainer with this process's uid (checked once, by a real start)."""
    return _probe(os.geteuid())


def require() -> Isolation:
    """:func:`probe`, or :class:`SandboxUnavailable` saying what is missing and how to opt out."""
    iso = probe()
    if not iso.available:
        raise SandboxUnavailable(
            f"code reward: {iso.missing}; the reward runs model code only in the OS sandbox "
            "(set reward.options.sandbox=unsafe_local to run it without any isolation)"
        )
    return iso
