"""Memory outside the cap: unread TCP buffers on the sandbox's own loopback (kernel memory, counted in no
process; 670 MiB once held with memory_mb=64). Right answer only if at least 64 MiB sat unread."""

import socket

held = 0
try:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    keep = [server]
    for _ in range(28):
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        keep += [client, peer]
        client.setblocking(False)
        try:
            while True:
                held += client.send(b"x" * (1 << 16))
        except BlockingIOError:
            pass
except OSError:
    pass


def add(a, b):
    return a + b if held >= 64 << 20 else a - b - 1000
