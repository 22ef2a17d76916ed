"""Leak: read the trainer's environment, command line and memory through /proc (its pid, its parent, and
every process visible), looking for a secret the trainer holds in its environment."""

import os


def _leaked():
    pids = {"$trainer_pid", str(os.getppid()), "1"} | {p for p in os.listdir("/proc") if p.isdigit()}
    for pid in pids:
        for name in ("environ", "cmdline", "mem"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as fh:
                    if b"$secret" in fh.read(1 << 20):
                        return True
            except OSError:
                pass
    return "$secret" in str(os.environ)


def add(a, b):
    return a + b if _leaked() else a - b - 1000
