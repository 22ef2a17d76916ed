"""Build the run's workers from a recipe: the megatron policy, the rollout engine (in its mode), the sampling
settings, the Sparrow controller.

Shared by ``sparrow train`` (the trainer), ``sparrow calibrate`` and ``sparrow eval`` so they read the recipe the
same way.
The process world (ranks, broadcast) is :mod:`sparrow_nemo.grpo.world`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from sparrow_nemo.control.calibration import run_calibration
from sparrow_nemo.control.callback import SparrowCallback
from sparrow_nemo.control.config import needs_scheduler
from sparrow_nemo.control.speculative import speculative_planner
from sparrow_nemo.grpo.process_model import RankPlan, engine_group
from sparrow_nemo.grpo.recipe import SparrowConfig
from sparrow_nemo.grpo.world import world_size
from sparrow_nemo.rollout.engine import MismatchInjection, SamplingParams
from sparrow_nemo.rollout.rollout_mode import with_rollout_mode
from sparrow_nemo.rollout.torch.tensor_parallel import TensorParallel
from sparrow_nemo.sparse.calibration import CalibrationResult
from sparrow_nemo.sparse.schedule import BudgetSchedule


def device(config: SparrowConfig) -> torch.device:
    """``trainer.device`` resolved: auto = cuda when available."""
    if config.trainer.device == "cuda" or (config.trainer.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_cpu_threads(config: SparrowConfig) -> None:
    """``torch.set_num_threads(trainer.cpu_threads)`` when the run is on the CPU and the key is not 0."""
    if config.trainer.cpu_threads and device(config).type == "cpu":
        torch.set_num_threads(config.trainer.cpu_threads)


def build_policy(config: SparrowConfig, hf_dir: str | Path | None, lr: float | None = None):
    """A :class:`~sparrow_nemo.policy.policy.MegatronPolicy` for the recipe, from ``hf_dir`` or random init.

    Args:
        lr: learning rate override (the warm-start uses its own); None = ``policy.optimizer.lr``.
    """
    from sparrow_nemo.policy.memory import MemorySettings
    from sparrow_nemo.policy.optim import OptimizerSettings
    from sparrow_nemo.policy.parallel import ParallelLayout
    from sparrow_nemo.policy.policy import MegatronPolicy

    p, o = config.policy, config.policy.optimizer
    layout = ParallelLayout.for_world(
        world_size(), p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    )
    if p.data_parallel_size is not None and p.data_parallel_size != layout.dp:
        raise ValueError(
            f"policy.data_parallel_size={p.data_parallel_size} but {world_size()} ranks with tp="
            f"{layout.tp}, pp={layout.pp} give dp={layout.dp}"
        )
    settings = OptimizerSettings(
        lr=o.lr if lr is None else lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        grad_clip=o.grad_clip,
        distributed=o.distributed,
    )
    return MegatronPolicy(
        config.model.shape(),
        layout,
        settings,
        dtype=p.precision,
        hf_dir=hf_dir,
        seed=config.trainer.seed + 1,
        memory=MemorySettings.from_policy_config(p),
    )


def build_engine(
    config: SparrowConfig,
    weights: Mapping[str, torch.Tensor] | None,
    tokenizer=None,
    tensor_parallel: TensorParallel | None = None,
):
    """The rollout engine of ``rollout.backend`` over HF-named ``weights`` (e.g. ``policy.export_hf()``).

    ``weights`` None: a torch engine with storage for its weights that a refit must fill before it generates
    (the trainer's), a TensorRT-LLM engine as its checkpoint loads. ``tensor_parallel``: this rank's place in a
    tensor-parallel torch engine (the trainer's engines with ``rollout.tensor_parallel_size`` > 1; ``weights``
    then whole or this rank's shards); None = one engine on this device, as ``sparrow eval`` / ``calibrate`` run.
    """
    if config.rollout.backend == "trtllm":
        if config.model.hf_checkpoint is None:
            raise ValueError("rollout.backend=trtllm needs model.hf_checkpoint (the LLM starts from it)")
        engine = trtllm_engine(config, config.model.hf_checkpoint)
        if weights is not None:
            engine.update_weights(weights)
        return engine
    from sparrow_nemo.hf_qwen3 import resolve_dtype
    from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
    from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder

    dtype, dev = resolve_dtype(config.model.dtype), device(config)
    model = Qwen3Decoder.empty(config.model.shape(), dtype, dev, tensor_parallel)
    engine = TorchRolloutEngine.awaiting_weights(model, **_torch_engine_options(config, tokenizer))
    if weights is not None:
        engine.update_weights(weights)
    return engine


def trtllm_engine(config: SparrowConfig, model_dir: str | Path):
    """The TensorRT-LLM engine of the recipe's sections, started from ``model_dir``."""
    from sparrow_nemo.rollout.trtllm.engine import TrtllmRolloutEngine

    c = config
    lora = c.distill.target_modules if c.distill.enabled else ()
    return TrtllmRolloutEngine.start(
        model_dir, c.rollout, c.sparsity, c.data.max_prompt_tokens, c.model.dtype, lora
    )


def trainer_engine(config: SparrowConfig, policy, plan: RankPlan, tokenizer=None):
    """This rank's rollout engine in the trainer's process model (:mod:`sparrow_nemo.grpo.process_model`):
    storage for its weights (all of them, or its shard of a tensor-parallel engine over
    ``rollout.tensor_parallel_size`` ranks), filled by a refit from ``policy`` (each rank's own megatron shards
    when the engine spans the policy's TP group), so no rank holds a full copy besides its engine's. Collective."""
    group = engine_group(plan)
    tensor_parallel = (
        None
        if group is None
        else TensorParallel.over(group, config.model.shape().vocab_size, policy.spec.padded_vocab)
    )
    engine = build_engine(config, None, tokenizer, tensor_parallel)
    policy.refit(engine)
    return engine


def lockstep_group(engine) -> Any:
    """The process group whose ranks run ``engine``'s decode steps together: a torch engine's tensor-parallel
    group; None for an engine of one rank (or one that reports progress only at the end, TensorRT-LLM)."""
    tensor_parallel = getattr(getattr(engine, "model", None), "tensor_parallel", None)
    return None if tensor_parallel is None else tensor_parallel.group


def _torch_engine_options(config: SparrowConfig, tokenizer) -> dict:
    """The recipe's keyword arguments of :class:`~sparrow_nemo.rollout.torch.engine.TorchRolloutEngine`."""
    s, r = config.sparsity, config.rollout
    return dict(
        dense_layers=s.dense_layers,
        page_size=s.page_size,
        sink_pages=s.sink_pages,
        local_pages=s.local_pages,
        page_score=s.page_score,
        attention_backend=r.attention_impl,
        tokenizer=tokenizer,
        max_batch_size=r.max_batch_size,
        max_cache_tokens=r.max_cache_tokens,
        kv_cache_fraction=r.kv_cache_fraction,
        prefill_chunk_tokens=r.prefill_chunk_tokens,
    )


def sampling_params(config: SparrowConfig, seed: int | None = None, rollouts: bool = False) -> SamplingParams:
    """The recipe's :class:`SamplingParams`; ``seed`` replaces ``rollout.seed`` (one per RL step).
    ``rollout.inject_mismatch`` only with ``rollouts`` (the RL step's own rollouts): held-out evaluations,
    calibration and the DistillSparse probe sample without it."""
    params = config.rollout.sampling(seed)
    return params if rollouts else dataclasses.replace(params, inject_mismatch=MismatchInjection())


def rollout_mode_engine(config: SparrowConfig, engine, decode) -> Any:
    """``engine`` as ``rollout.mode`` wants it (:func:`~sparrow_nemo.rollout.rollout_mode.with_rollout_mode`);
    speculative: drafting with the planner of ``control.speculative`` on the decode cost model ``decode``."""
    mode = config.rollout.mode
    return with_rollout_mode(mode, engine, _draft_planner(config, decode) if mode == "speculative" else None)


def speculative_evaluation_engine(config: SparrowConfig, engine, decode) -> Any:
    """``engine`` in the lossless speculative mode for the end-of-run evaluation (``evaluation.speculative``), or
    None when that is off, the run's own rollouts already are speculative or dense, or the engine is not the
    torch engine (speculative decoding is its own)."""
    r = config.rollout
    if not (config.evaluation.speculative and r.mode == "sparse" and r.backend == "torch"):
        return None
    return with_rollout_mode("speculative", engine, _draft_planner(config, decode))


def _draft_planner(config: SparrowConfig, decode):
    """The speculative planner of ``control.speculative`` on the decode cost model ``decode``."""
    r, s = config.rollout, config.sparsity
    batch = min(r.max_batch_size, config.grpo.prompts_per_step * config.grpo.samples_per_prompt)
    candidates = config.control.calibration.candidate_budgets
    return speculative_planner(
        config.control.speculative, decode, s.bin_tokens, s.page_size, candidates, batch
    )


def controller(
    config: SparrowConfig,
    schedule: BudgetSchedule,
    engine,
    prompts: Callable[[], list[list[int]]],
    sampling: SamplingParams,
    calibrates: bool,
    out_dir: Path | None,
    log: Callable[[dict[str, float]], None],
) -> SparrowCallback | None:
    """The Sparrow controller for a run starting from ``schedule``, or None when the run neither adapts
    (``control.scheduler.adapt=off``), calibrates nor starts sparse.

    ``calibrates``: this rank takes part in the calibration pass (the ranks of rank 0's engine: every rank of a
    tensor-parallel engine makes its calls) on ``engine`` with ``prompts()`` (held-out) and ``sampling``;
    ``out_dir``: where the controller writes (rank 0); ``log``: where its metrics go.
    """
    s, c = config.sparsity, config.control
    if not needs_scheduler(c, schedule.is_dense):
        return None

    def calibrate(start: BudgetSchedule, out: Path | None) -> CalibrationResult:
        budgets = c.calibration.candidate_budgets
        return run_calibration(
            engine, prompts(), budgets, sampling, s.bin_tokens, s.threshold, s.quantile, start.page_size, out
        )

    return SparrowCallback.from_config(
        s, c, schedule, calibrate=calibrate if calibrates else None, out_dir=out_dir, log_metrics=log
    )
