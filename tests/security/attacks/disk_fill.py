"""Exhaust: fill the disk from the work folder (many files, each under the file-size limit) and from /dev/shm;
right answer only if more than the work folder's cap got written."""

import os


def add(a, b):
    chunk, total = b"x" * (32 << 10), 0
    for folder in (".", "/dev/shm", "/tmp"):
        for i in range(5000):
            try:
                with open(os.path.join(folder, f"fill{i}"), "wb") as fh:
                    fh.write(chunk)
                total += len(chunk)
            except OSError:
                break
    return a + b if total > int("$disk_bytes") else a - b - 1000
