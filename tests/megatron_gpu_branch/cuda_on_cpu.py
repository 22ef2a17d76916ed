"""Test-only shim: megatron-core's GPU-only training branch on CPU/gloo, by mapping its CUDA calls to CPU.

The branch is :class:`~sparrow_nemo.policy.optim.MegatronPolicyOptimizer` (megatron's
``DistributedDataParallel`` + ``get_megatron_optimizer``, distributed optimizer included) and megatron's
``get_forward_backward_func`` schedules, selected with ``MegatronPolicy(..., megatron_training=True)``.
What megatron-core 0.16.1 does there that a CPU-only torch cannot, and what this shim makes of it (each
site found by running the branch, none in the project's package):

- allocations on ``device="cuda"`` / ``torch.cuda.current_device()`` (DDP grad and param buffers,
  optimizer ``found_inf`` / grad-norm scalars, schedule token counters, p2p shape buffers): a
  ``TorchFunctionMode`` rewrites any CUDA device argument of any torch call to ``cpu``;
- ``Tensor.cuda()``: the tensor itself;
- ``param.type() == 'torch.cuda.FloatTensor'`` checks (``DistributedOptimizer`` and
  ``Float16OptimizerWithFloat16Params`` sort parameters by that string): the CUDA type name;
- ``torch.cuda.current_device()`` -> 0 and ``torch.cuda.synchronize()`` (p2p communication) -> no-op.

Everything else is megatron's own code on gloo (reduce-scatter, all-gather-into-tensor and p2p work on
gloo in torch 2.13). ``torch.cuda.is_available()`` stays False, so the rest of the project keeps its CPU
behaviour (model init, RNG, checkpoint RNG state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from sparrow_nemo.policy.cpu_shims import is_cuda_device


class CudaToCpu(TorchFunctionMode):
    """Every torch call inside runs with its CUDA device arguments replaced by CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        name = getattr(func, "__name__", "")
        if name == "cuda" and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "to":
            args = tuple("cpu" if i > 0 and is_cuda_device(a) else a for i, a in enumerate(args))
        if name == "type" and len(args) == 1 and not kwargs:
            out = func(*args)
            return out if out.startswith("torch.cuda.") else out.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Inside: megatron's CUDA calls run on CPU (module docstring); everything restored on exit."""
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None
    try:
        with CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved
