"""Fixtures shared by the trainer's tests."""

from __future__ import annotations

import signal

import pytest


@pytest.fixture
def restore_stop_handlers():
    """TERM / USR1 handlers as before the test (a stopped run leaves them ignored for the process)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)
