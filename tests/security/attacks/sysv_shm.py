"""Memory outside the cap: System V shared memory attached, touched and detached holds its pages with no
process's resident size counting them (1,363 MiB once held with memory_mb=256). Right answer only if more
than twice the cap was held."""

import ctypes

libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
IPC_PRIVATE, IPC_CREAT, CHUNK = 0, 0o1000, 64 << 20
CAP = int("$memory_mb") << 20
held = 0
for _ in range(2 * CAP // CHUNK + 1):
    shm = libc.shmget(IPC_PRIVATE, CHUNK, IPC_CREAT | 0o600)
    if shm < 0:
        break
    address = libc.shmat(shm, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(address, 1, CHUNK)
    libc.shmdt(ctypes.c_void_p(address))
    held += CHUNK


def add(a, b):
    return a + b if held > 2 * CAP else a - b - 1000
