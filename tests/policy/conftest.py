"""Fixtures for the policy tests: a one-rank gloo world for the in-process tests."""

from __future__ import annotations

import pytest

from policy._helpers import single_rank_env


@pytest.fixture
def single_rank():
    """Yield ``initialize_parallel`` inside a 1-rank gloo environment; parallel state torn down after."""
    from sparrow_nemo.policy.parallel import destroy_parallel, initialize_parallel

    with single_rank_env():
        yield initialize_parallel
        destroy_parallel()
