"""Fixtures for the policy tests: a one-rank gloo world for the in-process tests."""

from __future__ import annotations

import os

import pytest

from policy._helpers import free_port


@pytest.fixture
def single_rank():
    """Yield a function ``start(layout, shape)`` that sets up a 1-rank megatron world; torn down after."""
    from sparrow_nemo.policy.parallel import destroy_parallel, initialize_parallel

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    yield initialize_parallel
    destroy_parallel()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
