"""A one-rank world starts on a free port even when the port it inherited is held (a parent's store)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def test_a_one_rank_world_does_not_take_an_inherited_busy_port() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {
            **os.environ,
            "RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        code = (
            "import torch.distributed as dist; from sparrow_nemo.grpo.world import start_processes; "
            "start_processes(); assert dist.get_world_size() == 1; dist.destroy_process_group()"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr[-2000:]
