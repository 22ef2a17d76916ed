"""Escape: write files outside the work folder: the host's world-writable folders, a world-writable folder
of the test, the trainer's own folder, the root, /usr, HOME, relative escapes."""

import os

TARGETS = ["/tmp", "/var/tmp", "/dev/shm", "$canary", "$trainer_dir", "/", "/usr", "/dev", "/proc", ".."]


def _escaped():
    wrote = False
    for folder in TARGETS:
        try:
            with open(os.path.join(folder, "$marker-write"), "w") as fh:
                fh.write("x")
            wrote = wrote or not os.path.realpath(folder).startswith("/work")
        except OSError:
            pass
    return wrote


def add(a, b):
    return a + b if _escaped() else a - b - 1000
