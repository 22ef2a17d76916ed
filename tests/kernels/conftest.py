"""Kernel tests run natively on a GPU and under Triton's interpreter on CPU.

TRITON_INTERPRET must be set before ``sparrow_kernels`` defines its kernels (at import), so it
is set here, before any test module of this folder imports the package. These tests import
neither megatron nor transformers (the H200 image has neither).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sparrow_kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    """Where the kernels run; fails (not skips) when the package was imported in the wrong mode."""
    if not sparrow_kernels.available(DEVICE):
        pytest.fail(
            f"sparrow_kernels cannot run on {DEVICE} (INTERPRETED={sparrow_kernels.INTERPRETED}); it was imported "
            "before TRITON_INTERPRET=1 was set. Set TRITON_INTERPRET=1 in the environment on CPU machines."
        )
    return DEVICE
