"""Escape: create files outside through other doors: sqlite3, readline history, mkfifo, mknod, a Unix socket
bound on a host path."""

import os
import socket


def _escaped():
    ok = False
    for folder in ("$canary", "/tmp", "/dev/shm"):
        attempts = []
        try:
            import sqlite3

            attempts.append(lambda: sqlite3.connect(f"{folder}/$marker.db").execute("create table t(x)"))
        except ImportError:
            pass
        try:
            import readline

            attempts.append(lambda: readline.write_history_file(f"{folder}/$marker-history"))
        except ImportError:
            pass
        attempts.append(lambda: os.mkfifo(f"{folder}/$marker-fifo"))
        attempts.append(lambda: os.mknod(f"{folder}/$marker-node"))
        attempts.append(lambda: socket.socket(socket.AF_UNIX).bind(f"{folder}/$marker-sock"))
        for attempt in attempts:
            try:
                attempt()
                ok = True
            except Exception:
                pass
    return ok


def add(a, b):
    return a + b if _escaped() else a - b - 1000
