"""The total memory cap of every live sandbox, watched by one thread of the trainer.

:data:`WATCH` sums the anonymous + shared resident memory of each watched sandbox's process tree every
:data:`POLL_S` seconds and kills a sandbox past its cap, whatever the trainer is doing meanwhile: waiting on
that sandbox, on another one (a program's sandbox while the checker works), decoding a reply, or scoring
another sample on another thread. The kernel bounds what can happen between two polls: ``RLIMIT_AS`` per
process, and a seccomp filter that denies the memory no resident size counts (System V shared memory,
memfds, non-Unix sockets; :mod:`sparrow_nemo.rewards.sandbox_seccomp`). docs/security.md lists what is left.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

#: seconds between two sums of a sandbox's memory
POLL_S = 0.01


def tree_memory(root: int) -> int:
    """Bytes of anonymous + shared resident memory of ``root`` and all its descendants (0 once gone)."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/status", "rb") as fh:
                for line in fh:
                    if line.startswith((b"RssAnon:", b"RssShmem:")):
                        total += int(line.split()[1]) << 10
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
    return total


@dataclass(frozen=True)
class _Watched:
    pid: int  # the sandbox's root process (a child of the trainer, not reaped while watched)
    cap: int  # bytes
    over: Callable[[], None]  # kills the sandbox; called with the watch's lock held


class MemoryWatch:
    """A daemon thread that polls every watched sandbox (started on the first :meth:`watch`)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked trainer starts its own thread

    def _reset(self) -> None:
        self._lock = threading.Condition()
        self._watched: dict[int, _Watched] = {}
        self._thread: threading.Thread | None = None

    def watch(self, key: int, pid: int, cap: int, over: Callable[[], None]) -> None:
        """Poll the process tree of ``pid``; call ``over()`` once when it holds more than ``cap`` bytes.

        ``pid`` must stay unreaped until :meth:`unwatch` (so that its number is not reused meanwhile).
        """
        with self._lock:
            self._watched[key] = _Watched(pid, cap, over)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sandbox-memory", daemon=True)
                self._thread.start()
            self._lock.notify()

    def unwatch(self, key: int) -> None:
        """Stop polling ``key``; once this returns, its ``over`` is not running and will not be called."""
        with self._lock:
            self._watched.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._watched:
                    self._lock.wait()
                snapshot = list(self._watched.items())
            # summed outside the lock (file reads); acted on only if still watched (its pid not reaped)
            over = [key for key, w in snapshot if tree_memory(w.pid) > w.cap]
            with self._lock:
                for key in over:
                    watched = self._watched.pop(key, None)
                    if watched is not None:
                        watched.over()
                self._lock.wait(POLL_S)


#: the trainer process's one watch
WATCH = MemoryWatch()
