"""Escape: start binaries every way Python can (subprocess, _posixsubprocess.fork_exec through it,
os.posix_spawn, os.system, fork + exec) and have them write outside and kill the victim process."""

import os
import subprocess

SCRIPT = "touch $canary/$marker-sh /tmp/$marker-sh; kill -9 $victim; /bin/kill -9 $victim"


def _escaped():
    for run in (
        lambda: subprocess.run(["/bin/sh", "-c", SCRIPT], timeout=2),
        lambda: os.waitpid(os.posix_spawn("/bin/sh", ["sh", "-c", SCRIPT], {}), 0),
        lambda: os.system(SCRIPT),
    ):
        try:
            run()
        except Exception:
            pass
    return os.path.exists("$canary/$marker-sh")


def add(a, b):
    return a + b if _escaped() else a - b - 1000
