"""The sandbox's seccomp filter: the system calls whose kernel objects would escape the sandbox's walls.

bubblewrap loads the filter (``--seccomp FD``, a classic-BPF program) into the sandbox's init and program
with ``no_new_privs``; every process they start inherits it. A call the filter denies fails with ``EPERM``
(sockets of another family than ``AF_UNIX``: ``EAFNOSUPPORT``), as on a kernel built without it, so a
program that tries one sees an ordinary error. Denied, and why:

- ``keyctl``, ``add_key``, ``request_key``: the kernel keyrings. A process inherits its parent's session
  keyring, so without this a program could read, overwrite or plant the trainer's keys (Kerberos / AFS
  tokens of a Slurm job live there).
- ``shmget``, ``shmat``, ``shmctl``, ``semget``, ``semop``, ``semtimedop``, ``semctl``, ``msgget``,
  ``msgsnd``, ``msgrcv``, ``msgctl``, ``mq_open``: System V IPC and POSIX message queues, memory that no
  process's resident size counts (a segment attached, touched and detached stays allocated).
- ``socket`` of any family but ``AF_UNIX``: the network namespace's loopback would hold unread TCP and UDP
  buffers outside every per-process limit (the host's ``tcp_mem`` is global).
- ``memfd_create``, ``memfd_secret``: anonymous files whose pages count in no resident size once unmapped.
- ``io_uring_setup``, ``io_uring_enter``, ``io_uring_register``, ``userfaultfd``, ``bpf``,
  ``perf_event_open``: large kernel attack surface no test program needs.
- ``ptrace``, ``process_vm_readv``, ``process_vm_writev``, ``pidfd_getfd``: reaching into another process
  of the sandbox (its init included).

On x86-64 the 32-bit and x32 system-call entry points are closed too (their numbers differ and would pass
the checks above). The filter exists for x86-64 and aarch64; elsewhere :func:`seccomp_program` is None and
the sandbox is unavailable (:mod:`sparrow_nemo.rewards.sandbox_os`).
"""

from __future__ import annotations

import errno
import platform
import struct

#: denied system calls: name -> (x86-64 number, aarch64 number) (``asm/unistd_64.h``, ``asm-generic/unistd.h``)
DENIED: dict[str, tuple[int, int]] = {
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "shmget": (29, 194),
    "shmat": (30, 196),
    "shmctl": (31, 195),
    "semget": (64, 190),
    "semop": (65, 193),
    "semtimedop": (220, 192),
    "semctl": (66, 191),
    "msgget": (68, 186),
    "msgsnd": (69, 189),
    "msgrcv": (70, 188),
    "msgctl": (71, 187),
    "mq_open": (240, 180),
    "memfd_create": (319, 279),
    "memfd_secret": (447, 447),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "userfaultfd": (323, 282),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438),
}
#: ``socket``'s number (x86-64, aarch64): allowed for ``AF_UNIX`` only
SOCKET = (41, 198)
AF_UNIX = 1
#: ``AUDIT_ARCH_*`` of each supported machine, and its column in :data:`DENIED`
_ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}
_X32_SYSCALL_BIT = 0x40000000

# classic BPF (linux/filter.h, linux/seccomp.h)
_LD_ABS_W = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
# offsets in struct seccomp_data: nr, arch, then the arguments (low 32 bits of args[0] on little endian)
_NR, _ARCH, _ARG0 = 0, 4, 16


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The compiled filter for ``machine`` (``platform.machine()`` by default): the bytes bwrap's
    ``--seccomp`` reads (8 per instruction); None on a machine without a table here."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        return None
    audit_arch, column = _ARCHES[machine]
    deny = _RET_ERRNO | errno.EPERM
    prog = [
        _op(_LD_ABS_W, _ARCH),
        _op(_JEQ_K, audit_arch, jt=1),
        _op(_RET_K, _RET_KILL_PROCESS),  # another ABI (i386 on x86-64): its numbers mean other calls
        _op(_LD_ABS_W, _NR),
    ]
    if machine == "x86_64":
        prog += [_op(_JGE_K, _X32_SYSCALL_BIT, jf=1), _op(_RET_K, deny)]
    for numbers in DENIED.values():
        prog += [_op(_JEQ_K, numbers[column], jf=1), _op(_RET_K, deny)]
    prog += [
        _op(_JEQ_K, SOCKET[column], jf=3),
        _op(_LD_ABS_W, _ARG0),
        _op(_JEQ_K, AF_UNIX, jt=1),
        _op(_RET_K, _RET_ERRNO | errno.EAFNOSUPPORT),
        _op(_RET_K, _RET_ALLOW),
    ]
    return b"".join(prog)
