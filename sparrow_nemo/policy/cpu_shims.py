"""The only place where megatron-core is adapted to run without a GPU.

megatron-core 0.16 assumes CUDA in a few spots that the CPU path of this project reaches:

- ``megatron.core.utils.GlobalMemoryBuffer.get_tensor`` allocates its scratch buffers on
  ``torch.cuda.current_device()`` (used by the local ``DotProductAttention``). On CPU it returns a
  fresh ``torch.empty`` of the requested shape and dtype (the buffer is only an allocation cache).
- ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on the first
  forward. On CPU the same rotary table is built where ``inv_freq`` already lives.
- ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings with pp > 1) moves the
  last stage's copy of the embedding to CUDA before the first/last-stage all-reduce that makes the
  two copies equal. On CPU the same all-reduce runs on the CPU tensor.
- Activation recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA RNG state
  (``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` in ``megatron.core.tensor_parallel.random``).
  On CPU there is none: the state is an empty tensor and restoring it does nothing (the CPU RNG
  state is saved and restored by megatron itself).
- The CUDA RNG tracker: ``model_parallel_cuda_manual_seed`` is called with
  ``inference_rng_tracker=True`` on CPU (see :func:`seed_model_parallel`), whose ``fork()`` does not
  touch CUDA RNG state. Dropout is 0 in every Qwen3 config, so no random stream is lost.

- Sharded checkpoints (``megatron.core.dist_checkpointing``, torch_dist strategy): its saver stages tensors with
  ``torch.cuda.synchronize()`` and agrees on failures through tensors on ``device="cuda"`` /
  ``torch.cuda.current_device()``. On CPU :func:`dist_checkpointing_on_cpu` runs the save or load with those
  device arguments mapped to ``cpu`` and the synchronisation a no-op.

What is *not* shimmed here (the CPU path uses the torch equivalents of :mod:`sparrow_nemo.policy.optim` and
:mod:`sparrow_nemo.policy.pipeline`): megatron's pipeline schedules (``torch.zeros(..., device="cuda")``
and CUDA p2p buffers), ``DistributedDataParallel`` (CUDA grad buffers) and the megatron optimizer
(CUDA ``found_inf`` / grad-norm tensors). The tests run that GPU branch on CPU anyway, through a
test-only shim that maps every CUDA allocation to CPU (``tests/megatron_gpu_branch/cuda_on_cpu.py``).

:func:`apply_cpu_shims` is a no-op when CUDA is available, so the GPU path is megatron-core's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
    """``GlobalMemoryBuffer.get_tensor`` on CPU: an uncached ``torch.empty(shape, dtype)``."""
    return torch.empty(tuple(tensor_shape), dtype=dtype)


def _cpu_get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` without the move to CUDA: [max_seq_len, 1, 1, rotary_dim] float32."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def _cpu_get_cuda_rng_state(*_args, **_kwargs) -> torch.Tensor:
    """``_get_cuda_rng_state`` without CUDA: an empty state."""
    return torch.empty(0, dtype=torch.uint8)


def _cpu_set_cuda_rng_state(*_args, **_kwargs) -> None:
    """``_set_cuda_rng_state`` without CUDA: nothing to restore."""


def _wrap_setup_embeddings(original):
    """``setup_embeddings_and_output_layer`` whose first/last-stage weight sync stays on CPU."""

    def setup(self) -> None:
        sync = torch.distributed.is_initialized() and self._is_in_embd_group()
        self._is_in_embd_group = lambda: False  # skip the original's ``.cuda()`` + all-reduce
        try:
            original(self)
        finally:
            del self._is_in_embd_group
        if sync and self.share_embeddings_and_output_weights and self.config.pipeline_model_parallel_size > 1:
            torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)

    return setup


def apply_cpu_shims() -> bool:
    """Patch megatron-core's CUDA-only helpers for CPU. Idempotent.

    Returns:
        True when the shims are (now) active, False when CUDA is available and nothing was changed.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    import megatron.core.tensor_parallel.random as mcore_random
    import megatron.core.utils as mcore_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.language_module.language_module import LanguageModule

    mcore_utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    RotaryEmbedding.get_emb = _cpu_get_emb
    mcore_random._get_cuda_rng_state = _cpu_get_cuda_rng_state
    mcore_random._set_cuda_rng_state = _cpu_set_cuda_rng_state
    LanguageModule.setup_embeddings_and_output_layer = _wrap_setup_embeddings(
        LanguageModule.setup_embeddings_and_output_layer
    )
    _APPLIED = True
    return True


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (CPU: the CUDA-free tracker)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
    else:
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def is_cuda_device(device) -> bool:
    """Whether a torch ``device=`` argument names a CUDA device (a bare int is a CUDA ordinal)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaDeviceToCpu(TorchFunctionMode):
    """Every torch call inside runs with a CUDA ``device=`` keyword replaced by ``cpu``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def dist_checkpointing_on_cpu() -> Iterator[None]:
    """Inside, megatron's sharded-checkpoint save and load run without CUDA (module docstring); a no-op
    context when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None
    try:
        with CudaDeviceToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved
