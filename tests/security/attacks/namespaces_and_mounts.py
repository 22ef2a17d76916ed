"""Escape: undo the sandbox from inside (a new user namespace to regain capabilities, remounting / or /usr
read-write, chroot, setuid to root)."""

import ctypes
import os

CLONE_NEWUSER, MS_REMOUNT, MS_BIND = 0x10000000, 32, 4096


def _escaped():
    libc = ctypes.CDLL(None, use_errno=True)
    ok = libc.unshare(CLONE_NEWUSER) == 0
    for target in (b"/", b"/usr"):
        ok = ok or libc.mount(None, target, None, MS_REMOUNT | MS_BIND, None) == 0
    for attempt in (lambda: os.setuid(0), lambda: os.chroot("/work")):
        try:
            attempt()
            ok = True
        except OSError:
            pass
    return ok


def add(a, b):
    return a + b if _escaped() else a - b - 1000
