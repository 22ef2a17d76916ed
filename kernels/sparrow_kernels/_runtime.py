"""Where the kernels can run (decided once at import time), and the one place they are launched.

Triton picks interpreter or compiled mode when a ``@triton.jit`` function is defined, from the
environment variable ``TRITON_INTERPRET``. So whether the kernels in this package run on CPU
tensors (interpreter, for tests) or on CUDA tensors (compiled) is fixed by the environment at the
moment ``sparrow_kernels`` is first imported. This module records that choice; it does not import
triton itself, so ``available()`` answers even where triton is not installed.

Every kernel launch of the package goes through :func:`launch`. Inside :func:`recorded_launches`
the launches are recorded instead of run (the host-side checks, allocations and launch
configuration still happen): ``sparrow_kernels.aot`` compiles exactly what the JIT would compile
from those records, and tests count the launches of one decode step.

Under the interpreter every scalar of a kernel is a one-element NumPy array, and a loop bound such as
``range(start, end, CHUNK)`` is turned into a Python int by ``int(array)``. NumPy 2.4 refuses that for arrays
of one dimension; Triton 3.7 and later squeeze the array first, Triton 3.6 does not, so there every kernel
loop with a run-time bound fails (first at ``selection.py``'s output loop). No kernel expression avoids it
(reductions and loads give one-element arrays too), so :func:`launch` re-applies the later interpreters'
squeeze to an interpreter that needs it (:func:`_fix_interpreter_index`, once).
"""

from __future__ import annotations

import contextlib
import importlib.util
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

#: True when the kernels were defined under ``TRITON_INTERPRET=1`` (they then run on CPU tensors).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: True when the ``triton`` package can be imported.
HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


@dataclass
class Launch:
    """One recorded kernel launch: the ``@triton.jit`` function, its grid, positional arguments and
    keyword arguments (constexprs and launch options such as num_warps / num_stages)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


_recording: list[list[Launch]] = []
_interpreter_checked = False


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``.

    CUDA devices need a working CUDA runtime and compiled (not interpreted) kernels; CPU needs
    the kernels to have been imported under ``TRITON_INTERPRET=1``. Anything else (another
    device type, or triton missing) returns False, so callers fall back to the torch reference.
    Inside :func:`recorded_launches` CPU tensors are accepted too (nothing runs).
    """
    device = torch.device(device)
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available() and not INTERPRETED
    if device.type == "cpu":
        return INTERPRETED or bool(_recording)
    return False


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Run ``kernel[grid](*args, **kwargs)``, or record it inside :func:`recorded_launches`."""
    global _interpreter_checked
    if _recording:
        _recording[-1].append(Launch(kernel, grid, args, kwargs))
        return
    if INTERPRETED and not _interpreter_checked:
        _fix_interpreter_index()
        _interpreter_checked = True
    kernel[grid](*args, **kwargs)


def _fix_interpreter_index() -> bool:
    """Make the interpreter's scalar ``__index__`` squeeze its one-element array (Triton 3.6 under NumPy >= 2.4;
    see the module docstring). Probes the interpreter's own patch on a stand-in class and wraps it only when
    that raises; returns whether it did."""
    from types import SimpleNamespace

    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    class Scalar:  # stands in for tl.tensor: the patch only sets attributes on the class
        def __init__(self) -> None:
            self.handle = SimpleNamespace(data=np.array([3], dtype=np.int32))

    scope = interpreter._LangPatchScope()
    original(Scalar, scope)
    try:
        operator.index(Scalar())
        return False
    except TypeError:
        pass
    finally:
        scope.restore()

    def patched(tensor: type, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    return True


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Record (do not run) every kernel launch inside the block; yields the list of :class:`Launch`.

    Host-side work still runs: argument checks, output allocation, launch sizing. Outputs stay
    uninitialised. Torch ops the entry points issue themselves would still run (there are none on
    the decode path: that is what the launch-count tests check).
    """
    _recording.append([])
    try:
        yield _recording[-1]
    finally:
        _recording.pop()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 = H100/H200 SXM, for sizing launches off-GPU)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << max(n - 1, 0).bit_length()
