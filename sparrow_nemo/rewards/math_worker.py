"""The math check outside the main thread: a spawned worker process, killed when an answer runs out of time.

``SIGALRM`` reaches only the main thread, so a reward called from a thread pool checks its answer here: one
worker process per trainer process (spawned on first use, so no lock or thread state is inherited), one
answer at a time (a lock). At the deadline the worker is killed and the answer scores 0; the next answer
starts a fresh worker (~1-2 s: it imports math_verify).
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

#: seconds a fresh worker may take to import math_verify
_START_S = 120.0
_lock = threading.Lock()
_worker: tuple[Any, Any] | None = None  # (process, parent end of the pipe)


def _serve(conn: Any) -> None:
    """The worker's loop: (task, args) in, bool out (False on any error)."""
    from sparrow_nemo.rewards.math_check import judge

    conn.send("ready")
    while True:
        try:
            task, args = conn.recv()
        except EOFError:
            return
        try:
            ok = bool(judge(task, args))
        except Exception:
            ok = False
        conn.send(ok)


def _start() -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(child,), daemon=True, name="sparrow-math-check")
    process.start()
    child.close()
    if not parent.poll(_START_S) or parent.recv() != "ready":
        process.kill()
        raise OSError(f"the math check worker did not start within {_START_S:.0f} s")
    return process, parent


def _stop() -> None:
    global _worker
    if _worker is not None:
        process, conn = _worker
        process.kill()
        process.join(timeout=10)
        conn.close()
        _worker = None


def judge_in_worker(task: str, args: tuple, timeout_s: float | None) -> bool:
    """``math_check.judge(task, args)`` in the worker within ``timeout_s`` seconds (None: no limit; counted once the
    worker is up); False on a timeout, a dead worker or any error."""
    global _worker
    with _lock:
        try:
            if _worker is None:
                _worker = _start()
            conn = _worker[1]
            conn.send((task, args))
            if conn.poll(None if timeout_s is None else float(timeout_s)):
                return bool(conn.recv())
        except (EOFError, OSError):
            pass
        _stop()  # out of time or dead: kill it, the next answer gets a fresh one
        return False
