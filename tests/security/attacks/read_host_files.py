"""Leak: read what the host holds: the training data (the expected outputs), the trainer's folder, this
repository, /etc, /root, /home, through /proc/<pid>/root too."""

import os


def _read_any():
    for path in (
        "$data_path",
        "$trainer_dir",
        "$repo",
        "/etc/passwd",
        "/etc/hostname",
        "/root",
        "/home",
        "/proc/1/root/etc/passwd",
        "/proc/self/root/etc/passwd",
    ):
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                open(path, "rb").read(16)
            return True
        except OSError:
            pass
    return False


def add(a, b):
    return a + b if _read_any() else a - b - 1000
