"""Exhaust: fork without end; every child becomes a long sleeper (marked, to be found if it survives)."""

import os
import sys


def add(a, b):
    while True:
        try:
            pid = os.fork()
        except OSError:
            continue
        if pid == 0:
            try:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "$marker"])
            except OSError:
                os._exit(0)
