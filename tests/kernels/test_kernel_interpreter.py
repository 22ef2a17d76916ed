"""Triton 3.6's interpreter under NumPy >= 2.4: ``sparrow_kernels`` re-applies the later interpreters' squeeze.

That interpreter holds every kernel scalar as a one-element NumPy array and turns a loop bound into an int with
``int(array)``, which NumPy 2.4 refuses for arrays of one dimension, so every kernel loop with a run-time bound
failed (first ``selection.py``'s output loop). Here Triton 3.6's ``__index__`` is put back into the installed
interpreter; the package's fix must detect it and the kernels then run and match the method layer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import check_selection, random_case
from sparrow_kernels import _runtime


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU only")
def test_triton36_scalar_index_is_fixed_and_kernels_run(device: torch.device, monkeypatch) -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def triton36(tensor, scope) -> None:  # Triton 3.6's own: int() of the one-element array, not squeezed
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", triton36)
    refuses = tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4)  # NumPy 2.4 made it an error
    assert _runtime._fix_interpreter_index() is refuses
    assert _runtime._fix_interpreter_index() is False  # fixed: nothing left to do
    case = random_case([77, 160, 5, 123], [48, 96, 16, 2048], num_kv_heads=2, group=4, device=device, seed=3)
    check_selection(case, case.budget)  # selection.py's loops over run-time bounds
