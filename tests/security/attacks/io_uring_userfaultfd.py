"""Kernel attack surface: io_uring and userfaultfd (the favourite tools of kernel exploits). Right answer
only if either can be had."""

import ctypes

libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
ring = libc.syscall(int("$nr_io_uring_setup"), 4, params)
uffd = libc.syscall(int("$nr_userfaultfd"), 0)


def add(a, b):
    return a + b if ring >= 0 or uffd >= 0 else a - b - 1000
