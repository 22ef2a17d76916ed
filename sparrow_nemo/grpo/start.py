"""The weights a one-process tool (``sparrow calibrate``, the benchmarks) starts the rollout engine from.

Not in :mod:`sparrow_nemo.grpo.setup`, which :mod:`sparrow_nemo.grpo.warmstart` imports, and not in
``warmstart.py`` itself, whose bytes are part of every warm-start's cache key (``WARMSTART_SOURCES``).
"""

from __future__ import annotations

import torch

from sparrow_nemo.grpo.prompt_source import PromptSource
from sparrow_nemo.grpo.recipe import SparrowConfig


def start_weights(
    config: SparrowConfig, source: PromptSource, show_progress: bool = True
) -> dict[str, torch.Tensor]:
    """HF-named weights a one-process tool (``sparrow calibrate``, benchmarks) starts the rollout from:
    ``model.hf_checkpoint``, else the warm-start (trained first when missing, in its own process group) when
    ``warmstart.enabled``, else random weights of the recipe's shape seeded ``trainer.seed``."""
    from sparrow_nemo.grpo import world
    from sparrow_nemo.grpo.warmstart import ensure_warm_start
    from sparrow_nemo.policy.parallel import destroy_parallel
    from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder

    hf_dir = config.model.hf_checkpoint
    if hf_dir is None and config.warmstart.enabled:
        world.start_processes()
        try:
            hf_dir = ensure_warm_start(config, source, show_progress)
        finally:
            destroy_parallel()
    if hf_dir is not None:
        return Qwen3Decoder.from_hf_dir(hf_dir).params
    return Qwen3Decoder.random(config.model.shape(), seed=config.trainer.seed).params
