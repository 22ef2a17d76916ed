"""The red-team harness: a hostile host to attack, the attack programs, and what each must leave behind.

:class:`Targets` sets up what an escaped program would go for, each with a way to tell whether it was hit:
a world-writable folder and a folder of the trainer's user (nothing new may appear), a victim process of
the trainer's user (must stay alive), a TCP listener on 127.0.0.1 and a Unix socket (path and abstract;
nobody may connect), a training JSONL holding the expected outputs, a secret in the trainer's environment
and, as a ``user`` key, in the trainer's session keyring (it may be neither read, changed nor joined by
another key), and a marker that every process an attack starts carries on its command line (none may be
left).

Attack programs are the files of ``attacks/`` (one attack each, its docstring says which), with ``$name``
placeholders filled from :meth:`Targets.fields`. Each is a completion for :data:`ADD_SPECS` (a function
``add``) or, named ``stdio_*``, for :data:`STDIO_SPEC`; each returns a wrong answer unless its attack
worked, so a reward above 0 means the sandbox failed. Used by the tests and by ``_as_user.py``, which runs
the same attacks with the trainer as an unprivileged user.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import socket
import string
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sparrow_nemo.rewards.code import code_reward

ATTACKS = Path(__file__).with_name("attacks")
REPO = Path(__file__).resolve().parents[2]
#: short limits: the suite stays fast; generous enough for a loaded 2-core machine to start a sandbox
LIMITS = {
    "wall_s": 4.0,
    "cpu_s": 2,
    "memory_mb": 256,
    "disk_mb": 16,
    "output_bytes": 65536,
    "max_processes": 16,
}
#: the tests use a builtin, a module and (assert lists) a helper of the trusted setup: names an attack may
#: try to rebind in the checker
_ADD_TESTS = [
    "assert add(2, 3) == 5",
    "assert abs(add(-1, 1)) == 0",
    "assert math.isclose(add(10, 20), 30) and sorted([add(1, 1), 1]) == [1, 2]",
    "assert expect(add(4, 4), 8)",
]
ADD_SPECS = {
    "humaneval": {
        "format": "humaneval",
        "prompt": 'import math\n\n\ndef expect(got, want):\n    return got == want\n\n\ndef add(a, b):\n    """a + b"""\n',
        "test": "def check(candidate):\n"
        + "".join(f"    {t.replace('add', 'candidate')}\n" for t in _ADD_TESTS)
        + "    assert add(0, 0) == 0\n",  # by its name, as some HumanEval tests do
        "entry_point": "add",
        "limits": LIMITS,
    },
    "asserts": {
        "format": "asserts",
        "setup": "import math\n\n\ndef expect(got, want):\n    return got == want\n",
        "tests": _ADD_TESTS,
        "limits": LIMITS,
    },
}
STDIO_SPEC = {"format": "stdio", "inputs": ["2 3\n"], "outputs": ["5"], "limits": LIMITS}
HONEST = "def add(a, b):\n    return a + b\n"
#: the honest controls' limits: the attacks' but a wall clock no machine load reaches
HONEST_LIMITS = {**LIMITS, "wall_s": 60.0}
HONEST_STDIO = "print(sum(map(int, input().split())))\n"
#: host folders anyone may write to: an escaped program's first choice
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
#: system-call numbers the attacks call directly (no libc wrapper), per machine
SYSCALLS = {
    "x86_64": {"keyctl": 250, "add_key": 248, "io_uring_setup": 425, "userfaultfd": 323},
    "aarch64": {"keyctl": 219, "add_key": 217, "io_uring_setup": 425, "userfaultfd": 282},
}
_KEY_SPEC_SESSION_KEYRING = -3
_KEYCTL_JOIN_SESSION_KEYRING, _KEYCTL_READ = 1, 11


def attack_names() -> list[str]:
    return sorted(p.stem for p in ATTACKS.glob("*.py"))


def honest(spec: dict) -> dict:
    """``spec`` with :data:`HONEST_LIMITS`."""
    return {**spec, "limits": HONEST_LIMITS}


def spec_for(name: str, fmt: str) -> dict:
    return STDIO_SPEC if name.startswith("stdio_") else ADD_SPECS[fmt]


@dataclass
class Targets:
    """What an attack may hit, for a trainer running as ``uid`` (the test's own, or nobody's)."""

    uid: int
    base: Path = field(init=False)
    marker: str = field(init=False)

    def __post_init__(self) -> None:
        self.marker = f"sparrow-attack-{os.urandom(6).hex()}"
        self.base = Path(tempfile.mkdtemp(prefix="sparrow_redteam_"))
        os.chmod(self.base, 0o755)
        self.canary = self.base / "world_writable"
        self.canary.mkdir(mode=0o777)
        os.chmod(self.canary, 0o777)
        self.trainer_dir = self.base / "trainer"
        self.trainer_dir.mkdir()
        self.data_path = self.trainer_dir / "train.jsonl"
        row = {"problem": "add", "answer": ADD_SPECS["asserts"], "expected_stdout": "5"}
        self.data_path.write_text(json.dumps(row) + "\n")
        os.chown(self.trainer_dir, self.uid, -1)
        os.chown(self.data_path, self.uid, -1)
        self.secret = f"secret-{os.urandom(8).hex()}"
        self.keyring = Keyring(self.marker, self.secret)
        self.victim = subprocess.Popen(["sleep", "600"], **_as(self.uid))
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(8)
        self.unix_path = self.base / "trainer.sock"
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(str(self.unix_path))
        os.chmod(self.unix_path, 0o777)
        self.unix.listen(8)
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind(f"\0{self.marker}")
        self.abstract.listen(8)
        for listener in (self.tcp, self.unix, self.abstract):
            listener.setblocking(False)
        self._baseline = self._listing()

    def fields(self, trainer_pid: int) -> dict[str, str]:
        return {
            "canary": str(self.canary),
            "trainer_dir": str(self.trainer_dir),
            "data_path": str(self.data_path),
            "repo": str(REPO),
            "marker": self.marker,
            "victim": str(self.victim.pid),
            "trainer_pid": str(trainer_pid),
            "port": str(self.tcp.getsockname()[1]),
            "unix_path": str(self.unix_path),
            "abstract": self.marker,
            "secret": self.secret,
            "disk_bytes": str(LIMITS["disk_mb"] << 20),
            "memory_mb": str(LIMITS["memory_mb"]),
            "key_name": self.keyring.name,
            **{f"nr_{name}": str(nr) for name, nr in SYSCALLS.get(platform.machine(), {}).items()},
        }

    def program(self, name: str, trainer_pid: int) -> str:
        return string.Template((ATTACKS / f"{name}.py").read_text()).substitute(self.fields(trainer_pid))

    def _listing(self) -> set[str]:
        """Entries of the test's own folders, and those of the host's shared folders carrying the marker
        (other programs of the machine write there meanwhile)."""
        found = {str(self.canary / n) for n in os.listdir(self.canary)}
        found |= {str(self.trainer_dir / n) for n in os.listdir(self.trainer_dir)}
        for folder in WORLD_WRITABLE:
            with contextlib.suppress(OSError):
                found |= {f"{folder}/{n}" for n in os.listdir(folder) if self.marker in n}
        return found

    def damage(self) -> list[str]:
        """Everything an attack left: new files, survivors, a dead victim, a connection. [] = none."""
        found = [f"file {p}" for p in sorted(self._listing() - self._baseline)]
        found += [f"process {pid}: {cmd}" for pid, cmd in survivors(self.marker)]
        if self.victim.poll() is not None:
            found.append(f"victim killed ({self.victim.returncode})")
        found += self.keyring.damage()
        for listener in (self.tcp, self.unix, self.abstract):
            try:
                conn, _ = listener.accept()
                conn.close()
                found.append(f"connection to {listener.getsockname()!r}")
            except BlockingIOError:
                pass
        return found

    def close(self) -> None:
        for proc in survivors(self.marker):
            os.kill(proc[0], 9)
        self.victim.kill()
        self.victim.wait()
        for listener in (self.tcp, self.unix, self.abstract):
            listener.close()
        for folder in WORLD_WRITABLE:
            for name in os.listdir(folder) if os.path.isdir(folder) else []:
                if self.marker in name:
                    os.unlink(os.path.join(folder, name))
        subprocess.run(["rm", "-rf", str(self.base)], check=False)


class Keyring:
    """A fresh session keyring of this process (inherited by the trainer and, unless the sandbox forbids
    it, by every program) holding one ``user`` key with the secret, as ``kinit`` / ``aklog`` leave tokens
    under Slurm's PAM. :meth:`damage` says if the key changed or another key joined it."""

    def __init__(self, marker: str, secret: str) -> None:
        self.name, self.secret = f"{marker}-token", secret.encode()
        numbers = SYSCALLS.get(platform.machine())
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self._keyctl = None if numbers is None else numbers["keyctl"]
        self.key = -1
        if numbers is not None and self._call(_KEYCTL_JOIN_SESSION_KEYRING, marker.encode()) > 0:
            payload = self.secret
            self.key = self._libc.syscall(
                numbers["add_key"],
                b"user",
                self.name.encode(),
                payload,
                len(payload),
                _KEY_SPEC_SESSION_KEYRING,
            )
        self._members = self._read(_KEY_SPEC_SESSION_KEYRING)

    def _call(self, *args: object) -> int:
        return self._libc.syscall(self._keyctl, *args) if self._keyctl is not None else -1

    def _read(self, key: int) -> bytes:
        buf = ctypes.create_string_buffer(4096)
        size = self._call(_KEYCTL_READ, key, buf, 4096)
        return buf.raw[: max(size, 0)]

    def damage(self) -> list[str]:
        if self.key <= 0:
            return []  # no keyrings here (a container's seccomp profile): nothing to steal
        found = [] if self._read(self.key) == self.secret else ["the trainer's key was changed"]
        if self._read(_KEY_SPEC_SESSION_KEYRING) != self._members:
            found.append("a key was planted in the trainer's session keyring")
        return found


def _as(uid: int) -> dict:
    return {} if uid == os.geteuid() else {"user": uid, "group": uid, "extra_groups": []}


def survivors(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose command line carries ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = (
                    Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
            if marker in cmd:
                found.append((int(entry), cmd))
    return found


def attack(targets: Targets, name: str, fmt: str, sandbox: str = "os") -> dict:
    """Run attack ``name`` as the completion of its spec in this process; its reward and the damage done."""
    reward = code_reward(targets.program(name, os.getpid()), spec_for(name, fmt), sandbox=sandbox)
    return {"attack": name, "format": fmt, "reward": reward, "damage": targets.damage()}


class UserTrainer:
    """A trainer process running as ``uid`` (``_as_user.py``: it drops to that user before any reward), fed
    one attack at a time; the damage of each is checked here, before the next starts."""

    def __init__(self, uid: int, targets: Targets) -> None:
        self.targets = targets
        env = {**os.environ, "SPARROW_TEST_SECRET": targets.secret}
        script = Path(__file__).with_name("_as_user.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(uid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.isolation = self._receive()

    def _receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            raise AssertionError(f"_as_user.py ended with status {self.proc.returncode}")
        return json.loads(line)

    def attack(self, name: str, fmt: str) -> dict:
        program = self.targets.program(name, self.proc.pid)
        self.proc.stdin.write(json.dumps({"program": program, "spec": spec_for(name, fmt)}) + "\n")
        self.proc.stdin.flush()
        reply = self._receive()
        return {"attack": name, "format": fmt, **reply, "damage": self.targets.damage()}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
