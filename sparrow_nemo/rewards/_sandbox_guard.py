"""Child-side bootstrap of the code sandbox (run as a script: ``python -I -S _sandbox_guard.py CONFIG``).

Standard library only. In order: read the JSON config (then delete it, so the program cannot read the
success token), set resource limits, enter the work directory, drop root privileges to the configured
uid/gid, install an audit hook, run the program as ``__main__``, and on success write the token to the
marker pipe. The parent counts a run as passed only when the token arrives, so a program that exits early
(``os._exit(0)``, a signal, ``sys.exit`` when tests follow) before its tests ran does not pass. This stops
accidental reward hacks, not a program written to attack this guard: the token sits in this process and
deliberate frame inspection could find it. The audit hook refuses: process creation (fork bomb guard),
sockets, signals to other processes, ctypes (which could bypass the hook), writes outside the work
directory, and reads of ``/proc/*/mem``.
"""

from __future__ import annotations

import builtins
import json
import os
import resource
import sys
from collections.abc import Callable
from typing import NoReturn

_CREATE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_BLOCKED_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.exec",
        "os.spawn",
        "os.system",
        "os.startfile",
        "subprocess.Popen",
        "pty.spawn",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "socket.__new__",
        "socket.socketpair",
        "socket.connect",
        "socket.bind",
        "socket.getaddrinfo",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "ctypes.call_function",
        "sys.addaudithook",
        "os.setuid",
        "os.setgid",
        "os.chroot",
    }
)
#: audit event -> indices of the arguments that are paths the event modifies
_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.symlink": (1,),
    "os.link": (1,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (1,),
    "shutil.copytree": (1,),
    "shutil.copymode": (1,),
    "shutil.copystat": (1,),
    "shutil.chown": (0,),
}


def _inside(path: object, root: str) -> bool:
    """``path`` (str/bytes/PathLike, or an int fd) resolves inside the directory ``root``."""
    if isinstance(path, int):  # an already open file descriptor
        return True
    if not isinstance(path, str | bytes | os.PathLike):
        return False
    real = os.path.realpath(os.fsdecode(path))
    return real == root or real.startswith(root + os.sep)


def _make_hook(root: str) -> Callable[[str, tuple], None]:
    """Audit hook refusing the events above and writes outside ``root`` (a resolved directory path)."""

    def hook(event: str, args: tuple) -> None:
        if event in _BLOCKED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in ("ctypes", "_ctypes"):
            raise PermissionError("sandbox: ctypes is not allowed")
        if event == "open":
            path, _mode, flags = args
            name = os.fsdecode(path) if isinstance(path, str | bytes) else ""
            if name.startswith("/proc/") and name.endswith("/mem"):
                raise PermissionError("sandbox: process memory is not readable")
            if flags is not None and flags & _CREATE_FLAGS and not _inside(path, root):
                raise PermissionError(f"sandbox: writing {path!r} outside the work directory")
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args) and not _inside(args[i], root):
                    raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the work directory")

    return hook


def _exit(code: object = None) -> NoReturn:
    """``exit()`` / ``quit()``, which ``site`` would provide (the guard runs with ``-S``)."""
    raise SystemExit(code)


def _limit(kind: int, value: int) -> None:
    soft = hard = value
    if kind == resource.RLIMIT_CPU:
        hard = value + 1  # SIGXCPU at the soft limit, SIGKILL a second later
    resource.setrlimit(kind, (soft, hard))


def main() -> None:
    config_path = sys.argv[1]
    with open(config_path) as fh:
        cfg = json.load(fh)
    os.unlink(config_path)
    _limit(resource.RLIMIT_CPU, cfg["cpu_s"])
    _limit(resource.RLIMIT_AS, cfg["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, cfg["file_size_bytes"])
    _limit(resource.RLIMIT_NPROC, cfg["max_processes"])
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, 64)
    root = os.path.realpath(cfg["workdir"])
    os.chdir(root)
    os.umask(0o077)
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    marker_fd, token, exit_ok = cfg["marker_fd"], cfg["token"].encode(), cfg["exit_ok"]
    with open(cfg["program"], encoding="utf-8") as fh:
        source = fh.read()
    del cfg
    sys.argv = ["program.py"]
    sys.path.insert(0, root)
    sys.addaudithook(_make_hook(root))
    passed = False
    try:
        code = compile(source, "program.py", "exec")
        builtins.exit = builtins.quit = _exit
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
        passed = True
    except SystemExit as exc:
        passed = exit_ok and exc.code in (None, 0)
    except BaseException as exc:
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        passed = False
    if passed:
        os.write(marker_fd, token)
    os._exit(0 if passed else 1)


if __name__ == "__main__":
    main()
