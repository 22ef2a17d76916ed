"""A guard that fails on a host read of a tensor value from this project's code (test support).

On a GPU, ``.item()``, ``.tolist()``, ``bool()``, ``int()``, ``float()``, ``.cpu()`` or ``.numpy()`` of a
device tensor waits for the device (and breaks CUDA-graph capture). On CPU there is no device to wait
for, so the guard looks at who asks: inside :func:`no_host_reads`, any of those calls made from a module
of ``sparrow_nemo`` or ``sparrow_kernels`` raises :class:`HostRead`; torch and Triton internals (the
interpreter that runs the kernels on CPU) are left alone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
_GUARDED = ("sparrow_nemo", "sparrow_kernels")


class HostRead(AssertionError):
    """This project's code read a tensor value on the host."""


@contextmanager
def no_host_reads() -> Iterator[None]:
    originals = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def guarded(name: str):
        original = originals[name]

        def method(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.split(".")[0] in _GUARDED:
                raise HostRead(f"{caller} called Tensor.{name}() on a {tuple(self.shape)} tensor")
            return original(self, *args, **kwargs)

        return method

    for name in _METHODS:
        setattr(torch.Tensor, name, guarded(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
