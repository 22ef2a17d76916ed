"""Outlive the reward: double-fork, setsid, ignore SIGTERM/SIGHUP, then keep running (and try to write
outside later)."""

import os
import signal
import sys
import time


def _spawn():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "$marker"])
        os._exit(0)
    time.sleep(0.2)


def add(a, b):
    _spawn()
    return a - b - 1000
