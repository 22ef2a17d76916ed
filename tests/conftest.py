"""Shared test setup: deterministic, single-threaded-friendly torch on a 2-core CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run under the interpreter on CPU-only machines; triton.jit reads this at decoration
# time, so it is set before any test module imports sparrow_kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# Tiny models: one thread is fastest, and tests run beside other work on a 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def shared_data() -> Path:
    """The read-only evaluation sets in ../shared/data (skips when the folder is absent)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA


@pytest.fixture
def sandbox() -> None:
    """Skips unless the code reward's OS sandbox starts here (bubblewrap and user namespaces)."""
    from sparrow_nemo.rewards.sandbox_os import probe

    iso = probe()
    if not iso.available:
        pytest.skip(f"no OS sandbox on this machine: {iso.missing}")
