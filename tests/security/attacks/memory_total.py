"""Exhaust: six processes that each stay under the per-process memory limit but together exceed the cap of
the whole program; right answer only if all six hold their memory at once."""

import os
import time

EACH = 100 << 20  # six of these are above the sandbox's memory_mb of the suite


def add(a, b):
    read, write = os.pipe()
    for _ in range(6):
        if os.fork() == 0:
            block = bytearray(EACH)
            for i in range(0, EACH, 4096):
                block[i] = 1
            os.write(write, b"k")
            time.sleep(30)
            os._exit(0)
    got = b""
    while len(got) < 6:
        got += os.read(read, 6)
    return a + b
