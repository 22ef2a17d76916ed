"""Escape: reach the host's network: TCP to a listener of the test on 127.0.0.1, its Unix socket (a path and
an abstract name), DNS resolution."""

import socket


def _reached():
    ok = False
    attempts = [
        lambda: socket.create_connection(("127.0.0.1", int("$port")), timeout=1),
        lambda: socket.socket(socket.AF_UNIX).connect("$unix_path"),
        lambda: socket.socket(socket.AF_UNIX).connect("\0$abstract"),
        lambda: socket.getaddrinfo("pypi.org", 443),
        lambda: socket.gethostbyname("localhost"),
    ]
    for attempt in attempts:
        try:
            attempt()
            ok = True
        except Exception:
            pass
    return ok


def add(a, b):
    return a + b if _reached() else a - b - 1000
