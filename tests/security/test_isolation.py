"""What a program sees inside the sandbox, what happens where the sandbox cannot be had, and proof that the
red-team checks can fail (the same attacks, run without isolation, do damage they detect)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from sparrow_nemo.rewards import sandbox_os
from sparrow_nemo.rewards.code import code_reward
from sparrow_nemo.rewards.code_sandbox import SandboxLimits, SandboxProcess, limits_json, run_python
from sparrow_nemo.rewards.sandbox_os import SandboxUnavailable
from sparrow_nemo.rewards.sandbox_seccomp import DENIED

from ._hostile import ADD_SPECS, REPO, Targets, honest

INSIDE = """
import ctypes, json, os, socket
mounts = [line.split()[1:4] for line in open('/proc/self/mounts')]
print(json.dumps({
    "uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),
    "top": sorted(os.listdir('/')), "interfaces": sorted(os.listdir('/sys/class/net')) if os.path.isdir('/sys/class/net') else [],
    "hostname": socket.gethostname(), "env": sorted(os.environ), "cwd": os.getcwd(),
    "writable": sorted(m[0] for m in mounts
                       if 'rw' in m[2].split(',') and m[1] not in ('proc', 'devpts') and os.path.isdir(m[0])),
    "work": [m for m in mounts if m[0] == '/work'][0],
    "caps": [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0],
    "new_userns": ctypes.CDLL(None).unshare(0x10000000),  # CLONE_NEWUSER
}))
"""


def test_what_the_program_sees(sandbox: None) -> None:
    r = run_python(INSIDE, "", SandboxLimits(disk_mb=8))
    assert r.ok, r.stderr
    seen = json.loads(r.stdout)
    assert seen["uid"] == (os.geteuid() if os.geteuid() != 0 else 65534)
    assert seen["pids"] == [1, 2]  # bwrap's init and the program: no host process is visible
    assert seen["top"] == sorted(["work", "sandbox", "usr", "proc", "dev", *_host_top_links()])
    assert "tmp" not in seen["top"] and "etc" not in seen["top"] and "home" not in seen["top"]
    assert seen["hostname"] == "sandbox" and seen["cwd"] == "/work"
    assert seen["env"] == ["HOME", "LANG", "PATH", "PWD", "PYTHONIOENCODING"]
    # /, /dev (and so /dev/shm), /usr, /sandbox are read-only; besides /work only device nodes (/dev/null...)
    assert seen["writable"] == ["/work"]
    assert "size=8192k" in seen["work"][2]
    assert seen["caps"] == "0000000000000000" and seen["new_userns"] == -1


#: three processes of 96 MiB each: each under RLIMIT_AS (128 MiB), together over the sandbox's cap
_THREE_HOLDERS = """
import os, time
for _ in range(3):
    if os.fork() == 0:
        block = bytearray(96 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(60)
        os._exit(0)
time.sleep(60)
"""


def test_every_sandbox_is_watched_while_the_trainer_does_something_else(sandbox: None) -> None:
    """The total memory cap holds although nothing here waits on this sandbox (the trainer waiting on the
    checker, decoding a reply, scoring on another thread): the trainer's memory watch polls every live box."""
    limits = SandboxLimits(wall_s=60.0, memory_mb=128, max_processes=8)
    files = {"program.py": _THREE_HOLDERS.encode()}
    with SandboxProcess("_sandbox_program.py", ["stdio", limits_json(limits)], limits, files, b"") as box:
        deadline = time.monotonic() + 60
        while box.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)  # never receive() or wait(): nobody pumps this sandbox
        assert box.failure == "memory limit"


#: every denied call from inside, printing the errno it got (0: it worked)
_DENIED_CALLS = """
import ctypes, json, platform, socket
libc = ctypes.CDLL(None, use_errno=True)
column = {"x86_64": 0, "aarch64": 1}[platform.machine()]
got = {}
for name, numbers in json.loads(input()).items():
    ctypes.set_errno(0)
    libc.syscall(numbers[column], 0, 0, 0, 0, 0, 0)
    got[name] = ctypes.get_errno()
for family in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"):
    try:
        socket.socket(getattr(socket, family), socket.SOCK_DGRAM if family == "AF_NETLINK" else socket.SOCK_STREAM)
        got[family] = 0
    except OSError as exc:
        got[family] = exc.errno
socket.socketpair()  # Unix sockets stay: asyncio's event loop needs them
print(json.dumps(got))
"""


def test_the_seccomp_filter_denies_its_calls_and_leaves_the_rest(sandbox: None) -> None:
    r = run_python(_DENIED_CALLS, json.dumps(DENIED) + "\n", SandboxLimits(wall_s=60.0))
    assert r.ok, r.stderr
    got = json.loads(r.stdout)
    assert {name: got[name] for name in DENIED} == dict.fromkeys(DENIED, errno.EPERM)
    assert {got[f] for f in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET")} == {errno.EAFNOSUPPORT}
    inside = run_python(
        "import os, subprocess\nprint(open('/proc/1/status').read().split('Seccomp:')[1].split()[0])\n"
        "print(subprocess.run(['/bin/echo', 'ok'], capture_output=True, text=True).stdout.strip())\n",
        "",
        SandboxLimits(wall_s=60.0),
    )
    # the namespace's init is filtered too (a program could write into it through /proc/1/mem), and
    # programs still start programs
    assert inside.ok and inside.stdout.split() == ["2", "ok"], inside.stderr


def _host_top_links() -> list[str]:
    return [d.lstrip("/") for d in sandbox_os._HOST_TOP_DIRS if os.path.islink(d) or os.path.isdir(d)]


def test_without_bubblewrap_the_reward_refuses_unless_unsafe_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sandbox_os.shutil, "which", lambda name: None)
    sandbox_os._probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match=r"bubblewrap is not installed.*unsafe_local"):
            code_reward("def f():\n    return 1\n", ["assert f() == 1"])
        assert code_reward("def f():\n    return 1\n", ["assert f() == 1"], sandbox="unsafe_local") == 1.0
    finally:
        sandbox_os._probe.cache_clear()


def test_without_user_namespaces_the_reward_refuses(sandbox: None) -> None:
    """A trainer in a namespace where no user namespace may be created (as on a machine with
    ``user.max_user_namespaces=0``): one line naming it, and the unsafe mode still works."""
    if os.geteuid() != 0:
        pytest.skip("building a machine without user namespaces needs root here")
    script = (
        "from sparrow_nemo.rewards.code import code_reward\n"
        "try:\n"
        "    code_reward('def f():\\n    return 1\\n', ['assert f() == 1'])\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
        "print(code_reward('def f():\\n    return 1\\n', ['assert f() == 1'], sandbox='unsafe_local'))\n"
    )
    cmd = [shutil.which("bwrap"), "--unshare-user", "--disable-userns", "--uid", "1000", "--gid", "1000"]
    cmd += ["--dev-bind", "/", "/", "--chdir", str(REPO), "--", sys.executable, "-c", script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stderr
    assert lines[0].startswith("refused: code reward: bwrap cannot start a sandbox as uid 1000")
    assert "namespace" in lines[0] and "unsafe_local" in lines[0]
    assert lines[1] == "1.0"


@pytest.mark.parametrize("name", ["write_outside", "setsid_survivor", "network"])
def test_the_checks_catch_an_unsandboxed_attack(name: str) -> None:
    """Control: without isolation these attacks work, and the red-team checks see it."""
    targets = Targets(os.geteuid())
    try:
        program = targets.program(name, os.getpid())
        code_reward(program, honest(ADD_SPECS["humaneval"]), sandbox="unsafe_local")
        assert targets.damage()
    finally:
        targets.close()
