"""Where the kernels can run, decided once at import time.

Triton picks interpreter or compiled mode when a ``@triton.jit`` function is defined, from the
environment variable ``TRITON_INTERPRET``. So whether the kernels in this package run on CPU
tensors (interpreter, for tests) or on CUDA tensors (compiled) is fixed by the environment at the
moment ``sparrow_kernels`` is first imported. This module records that choice; it does not import
triton itself, so ``available()`` answers even where triton is not installed.
"""

from __future__ import annotations

import importlib.util
import os

import torch

#: True when the kernels were defined under ``TRITON_INTERPRET=1`` (they then run on CPU tensors).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: True when the ``triton`` package can be imported.
HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``.

    CUDA devices need a working CUDA runtime and compiled (not interpreted) kernels; CPU needs
    the kernels to have been imported under ``TRITON_INTERPRET=1``. Anything else (another
    device type, or triton missing) returns False, so callers fall back to the torch reference.
    """
    device = torch.device(device)
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and not INTERPRETED
    if device.type == "cpu":
        return INTERPRETED
    return False


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for the CPU interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(n - 1, 0).bit_length()
