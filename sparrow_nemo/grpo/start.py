"""How a run starts: :func:`train` (``sparrow train``'s steps) and where the policy starts from.

:func:`start_checkpoint` (``model.hf_checkpoint`` or the task's supervised warm-start) is a step of :func:`train`
before the trainer is built, so that :class:`~sparrow_nemo.grpo.trainer.GrpoTrainer` builds and does not train;
the one-process tools (``sparrow calibrate``, the benchmarks) take their engine's weights from it too
(:func:`start_weights`).
Not in :mod:`sparrow_nemo.grpo.setup`, which :mod:`sparrow_nemo.grpo.warmstart` imports, and not in
``warmstart.py`` itself, whose code is part of every warm-start's cache key (``WARMSTART_SOURCES``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sparrow_nemo.grpo.prompt_source import PromptSource
from sparrow_nemo.grpo.recipe import SparrowConfig


def start_checkpoint(
    config: SparrowConfig, show_progress: bool = True, source: PromptSource | None = None
) -> str | None:
    """The HF folder the policy starts from: ``model.hf_checkpoint``, else the warm-start when
    ``warmstart.enabled`` (cached, shipped, or trained now: :func:`~sparrow_nemo.grpo.warmstart.ensure_warm_start`),
    else None (random init). Collective when it warm-starts: every rank of the run calls it.

    Args:
        source: the recipe's prompt source (built from the recipe when None; the warm-start reads its task's
            reference solutions and tokenizer, not its prompt stream).
    """
    if config.model.hf_checkpoint is not None or not config.warmstart.enabled:
        return config.model.hf_checkpoint
    from sparrow_nemo.grpo.prompts import build_prompt_source
    from sparrow_nemo.grpo.warmstart import ensure_warm_start

    source = build_prompt_source(config) if source is None else source
    return str(ensure_warm_start(config, source, show_progress))


def start_weights(
    config: SparrowConfig, source: PromptSource, show_progress: bool = True
) -> dict[str, torch.Tensor]:
    """HF-named weights a one-process tool (``sparrow calibrate``, benchmarks) starts the rollout from:
    :func:`start_checkpoint` (a warm-start trained in its own process group), else random weights of the
    recipe's shape seeded ``trainer.seed``."""
    from sparrow_nemo.grpo import world
    from sparrow_nemo.policy.parallel import destroy_parallel
    from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder

    hf_dir = config.model.hf_checkpoint
    if hf_dir is None and config.warmstart.enabled:
        world.start_processes()
        try:
            hf_dir = start_checkpoint(config, show_progress, source)
        finally:
            destroy_parallel()
    if hf_dir is not None:
        return Qwen3Decoder.from_hf_dir(hf_dir).params
    return Qwen3Decoder.random(config.model.shape(), seed=config.trainer.seed).params


def train(config: SparrowConfig, run_dir: str | Path | None = None) -> tuple[dict[str, Any], Path]:
    """``sparrow train`` on this rank: the process group, the CPU threads, the run folder's check, the
    warm-start (:func:`start_checkpoint`), then the trainer's run; the workers are closed after. Returns
    (summary, run folder)."""
    from sparrow_nemo.grpo import setup, world
    from sparrow_nemo.grpo.trainer import GrpoTrainer
    from sparrow_nemo.run_io.rundir import check_run_dir

    world.start_processes(config.trainer.dist_timeout_minutes)
    setup.apply_cpu_threads(config)
    if run_dir is not None:
        check_run_dir(config, run_dir)  # before the warm-start's work
    hf_dir = start_checkpoint(config, config.logging.progress_bar and world.rank() == 0)
    trainer = GrpoTrainer(config, run_dir, hf_dir)
    try:
        summary = trainer.fit()
    finally:
        trainer.policy.close()
    return summary, trainer.run_dir
