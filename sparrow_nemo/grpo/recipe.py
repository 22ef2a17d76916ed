"""The recipe: :class:`SparrowConfig` composes the components' config classes, one section each.

Every knob is declared once, in the component that reads it (listed below), with its doc
string (``sparrow config show --doc``) and its check; this module adds the GRPO loop's own sections and the
rules that span sections. Defaults are each component's own (mostly the paper's settings; docs/METHOD.md);
``recipes/tiny_cpu.yaml`` states the tiny CPU run in full.

- ``model``: :class:`~sparrow_nemo.model_shapes.ModelConfig` (``model_shapes.py``)
- ``policy``: :class:`~sparrow_nemo.policy.policy.PolicyConfig` (``policy/policy.py``); its ``optimizer``:
  :class:`~sparrow_nemo.policy.optim.OptimizerSettings` (``policy/optim.py``)
- ``rollout``: :class:`~sparrow_nemo.rollout.engine.RolloutConfig`, the sampling keys from
  :class:`~sparrow_nemo.rollout.engine.SamplingParams` (``rollout/engine.py``)
- ``sparsity``: :class:`~sparrow_nemo.sparse.config.SparsityConfig` (``sparse/config.py``; the pattern keys from
  ``sparse/pattern.py``)
- ``control``: :class:`~sparrow_nemo.control.config.ControlConfig` (``control/config.py``; its ``calibration``,
  ``scheduler`` and ``speculative`` parts from ``control/calibration.py``, ``scheduler.py``, ``speculative.py``)
- ``grpo``: :class:`GrpoConfig` (here); its ``loss``: :class:`~sparrow_nemo.grpo.losses.PolicyLossConfig`; its
  ``overlong``: :class:`~sparrow_nemo.grpo.shaping.OverlongConfig`; its ``dynamic_sampling``:
  :class:`~sparrow_nemo.grpo.dynamic_sampling.DynamicSamplingConfig`
- ``distill``: :class:`~sparrow_nemo.grpo.distill.DistillConfig` (``grpo/distill.py``, the DistillSparse phase)
- ``data``: :class:`~sparrow_nemo.grpo.data.PromptDataConfig`
- ``reward``: :class:`~sparrow_nemo.rewards.registry.RewardConfig`
- ``task``: :class:`~sparrow_nemo.tasks.chain.ChainTaskConfig`
- ``checkpoint``: :class:`~sparrow_nemo.grpo.checkpoint.CheckpointConfig`
- ``logging``: :class:`~sparrow_nemo.run_io.metrics.LoggingConfig`; its ``wandb``:
  :class:`~sparrow_nemo.run_io.wandb_logger.WandbConfig`
- ``evaluation``: :class:`~sparrow_nemo.grpo.evaluation.EvaluationConfig`
- ``warmstart``, ``trainer``: :class:`WarmstartConfig`, :class:`TrainerConfig` (here)
- ``callbacks``: user extras only (the trainer builds the controller and DistillSparse itself)

(The trainer's, the warm-start's and the GRPO loop's own sections live here because the modules that
read them, ``grpo/trainer.py`` and ``grpo/warmstart.py``, read the whole recipe.)
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from sparrow_nemo.config import compose
from sparrow_nemo.config.schema import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    Section,
    interval,
    knob,
    matching,
    one_of_names,
)
from sparrow_nemo.config.yaml_io import dump_yaml
from sparrow_nemo.control.config import ControlConfig
from sparrow_nemo.grpo.advantages import advantage_names
from sparrow_nemo.grpo.checkpoint import CheckpointConfig
from sparrow_nemo.grpo.data import PromptDataConfig
from sparrow_nemo.grpo.distill import DistillConfig
from sparrow_nemo.grpo.dynamic_sampling import DynamicSamplingConfig
from sparrow_nemo.grpo.evaluation import EvaluationConfig
from sparrow_nemo.grpo.losses import PolicyLossConfig
from sparrow_nemo.grpo.shaping import OverlongConfig
from sparrow_nemo.model_shapes import ModelConfig
from sparrow_nemo.policy.parallel import LayoutError, ParallelLayout
from sparrow_nemo.policy.policy import PolicyConfig
from sparrow_nemo.rewards.registry import RewardConfig
from sparrow_nemo.rollout.engine import RolloutConfig
from sparrow_nemo.run_io.metrics import LoggingConfig
from sparrow_nemo.sparse.config import SparsityConfig
from sparrow_nemo.tasks.chain import ChainTaskConfig, build_tasks

__all__ = [
    "SYNTHETIC_REWARD",
    "GrpoConfig",
    "SparrowConfig",
    "TrainerConfig",
    "WarmstartConfig",
    "from_dict",
    "load_config",
]

#: ``reward.type`` of the embedded synthetic task: its prompts come from the task, not from a file.
SYNTHETIC_REWARD = "chain"


@dataclass(frozen=True)
class GrpoConfig(Section):
    """The GRPO algorithm."""

    prompts_per_step: int = knob(16, "prompts sampled per RL step", check=AT_LEAST_ONE)
    samples_per_prompt: int = knob(8, "samples per prompt (the group; the paper: 8)", check=interval(lo=2))
    adv_estimator: str = knob(
        "grpo",
        "registered advantage estimator (sparrow_nemo.grpo.advantages): grpo, rloo (leave-one-out)",
        check=one_of_names(advantage_names),
    )
    normalize_std: bool = knob(True, "divide group-centred rewards by the group std (grpo estimator)")
    mini_batches_per_step: int = knob(
        2,
        "optimizer steps per RL step: the step's samples in this many mini-batches, old logprobs computed once "
        "before the first (1 = on-policy: PPO ratio exactly 1, the clip never acts; > 1: ratio and clip are "
        "real; sparrow_nemo.grpo.update)",
        check=AT_LEAST_ONE,
    )
    loss: PolicyLossConfig = knob(doc="the policy loss", factory=PolicyLossConfig)
    overlong: OverlongConfig = knob(
        doc="DAPO's overlong reward shaping of the training reward (grpo/shaping.py)", factory=OverlongConfig
    )
    dynamic_sampling: DynamicSamplingConfig = knob(
        doc="DAPO's dynamic sampling: train on groups with reward variance (grpo/dynamic_sampling.py)",
        factory=DynamicSamplingConfig,
    )


@dataclass(frozen=True)
class WarmstartConfig(Section):
    """Supervised warm-start on the task's reference solutions before RL (synthetic task only).

    The result is cached as an HF checkpoint under ``<cache_dir>/<key>/`` (:func:`sparrow_nemo.grpo.warmstart
    .cache_key`), so a second run skips it.
    """

    enabled: bool = knob(True, "run the warm-start (ignored when model.hf_checkpoint is given)")
    steps: int = knob(1200, "optimizer steps", check=AT_LEAST_ONE)
    batch_size: int = knob(16, "(prompt, solution) pairs per step", check=AT_LEAST_ONE)
    lr: float = knob(
        5e-3, "learning rate, constant (the other optimizer settings: policy.optimizer)", check=POSITIVE
    )
    num_hops: tuple[int, ...] | None = knob(
        None,
        "(min, max) hops of the warm-start problems; null = task.num_hops. Shorter than the task's = a "
        "curriculum: RL then meets longer chains than the warm-start saw (sparrow_nemo.tasks.chain.build_tasks)",
        check=AT_LEAST_ONE,
    )
    num_nodes: tuple[int, ...] | None = knob(
        None, "(min, max) table entries of the warm-start problems; null = task.num_nodes", check=AT_LEAST_ONE
    )
    filler_tokens: tuple[int, ...] | None = knob(
        None,
        "(min, max) haystack characters of the warm-start problems; null = task.filler_tokens (a minimum below "
        "the task's lets ramp_steps start on short prompts)",
        check=NON_NEGATIVE,
    )
    num_queries: tuple[int, ...] | None = knob(
        None,
        "(min, max) queries of the warm-start problems; null = task.num_queries (both > 1 or both 1: one format)",
        check=AT_LEAST_ONE,
    )
    init_from: str | None = knob(
        None,
        "a recipe whose warm-start this one continues (a curriculum stage: that checkpoint, cached, shipped or "
        "trained first, is where these steps start); null = random init",
    )
    slip_rate: float = knob(
        0.0,
        "per-hop probability that a demonstration's running sum is wrong (sparrow_nemo.tasks.chain): a warm-start "
        "that imitates a fallible teacher is partly competent, and RL (rewarded on the true answers) can beat it",
        check=interval(0.0, 1.0),
    )
    ramp_steps: int = knob(
        0,
        "steps over which the warm-start problems grow (geometrically; the filler and the queries linearly) from "
        "the ranges' minimum to their full sizes (0 = none): a small model finds the table look-up on small "
        "tables first",
        check=NON_NEGATIVE,
    )
    late_ramp_steps: tuple[int, ...] | None = knob(
        None,
        "(first, last) step of the filler's and the queries' own linear growth from their minimum to their "
        "maximum (before first: the minimum; the look-up is learned on short prompts and single walks, then the "
        "haystack or the many queries grow); null = with ramp_steps",
        check=NON_NEGATIVE,
    )
    cache_dir: str | None = knob(
        None,
        "cache folder; null = $SPARROW_CACHE/warmstart, else ~/.cache/sparrow_nemo/warmstart",
        hashed=False,
    )

    def check(self) -> None:
        for key in ("num_hops", "num_nodes", "filler_tokens", "num_queries", "late_ramp_steps"):
            value = getattr(self, key)
            if value is not None and (len(value) != 2 or value[0] > value[1]):
                raise self.invalid(key, "null or two integers [min, max] with 1 <= min <= max")
        ramp = self.late_ramp_steps
        if ramp is not None and ramp[0] == ramp[1]:  # the linear growth between them would divide by zero
            raise self.invalid("late_ramp_steps", "null or [first, last] with first < last")


@dataclass(frozen=True)
class TrainerConfig(Section):
    """The RL loop."""

    max_steps: int = knob(
        40, "RL steps to run (not hashed: a run may be extended)", check=AT_LEAST_ONE, hashed=False
    )
    seed: int = knob(0, "global seed (data order, initialisation)", check=NON_NEGATIVE)
    device: Literal["auto", "cpu", "cuda"] = knob("auto", "where to run; auto = cuda when available")
    cpu_threads: int = knob(
        1,
        "torch intra-op threads on the CPU (0 = torch's default, one per core). 1 is the fastest for the tiny "
        "models and keeps OpenMP threads from spinning against other processes on a busy machine",
        check=NON_NEGATIVE,
        hashed=False,
    )
    max_consecutive_nonfinite: int = knob(
        3,
        "abort after this many steps in a row whose update was skipped for a NaN/inf loss or gradient",
        check=AT_LEAST_ONE,
        hashed=False,
    )
    dist_timeout_minutes: float = knob(
        60.0,
        "timeout of every collective (torch.distributed.init_process_group), minutes. A rank that finished its "
        "rollout waits in the next collective for the slowest one: 60 covers a 40K-token rollout at a "
        "pessimistic 50 ms per decode step (34 min) with room; NCCL's own default (10 min) does not",
        check=POSITIVE,
        hashed=False,
    )


_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


@dataclass(frozen=True)
class SparrowConfig(Section):
    """A resolved recipe: every section typed and validated."""

    renamed_keys: ClassVar[dict[str, str]] = {"tail_scheduler": "it moved: control.scheduler"}

    name: str = knob(
        "tiny_cpu",
        "run name (letters, digits, . _ -); the default run folder is runs/<name>-<timestamp>",
        check=matching(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", "of letters, digits, . _ -"),
    )
    model: ModelConfig = knob(doc="the Qwen3 architecture and its weights", factory=ModelConfig)
    policy: PolicyConfig = knob(doc="the trained policy (megatron-core)", factory=PolicyConfig)
    rollout: RolloutConfig = knob(doc="generation: engine, sampling and batching", factory=RolloutConfig)
    sparsity: SparsityConfig = knob(
        doc="sparse decode attention and its schedule (docs/METHOD.md)", factory=SparsityConfig
    )
    control: ControlConfig = knob(
        doc="the Sparrow controller: calibration, the tail scheduler, the speculative planner",
        factory=ControlConfig,
    )
    grpo: GrpoConfig = knob(doc="the GRPO algorithm", factory=GrpoConfig)
    distill: DistillConfig = knob(
        doc="DistillSparse: a LoRA used only by the sparse rollout", factory=DistillConfig
    )
    data: PromptDataConfig = knob(
        doc="prompt files (the synthetic task needs none)", factory=PromptDataConfig
    )
    reward: RewardConfig = knob(doc="the verifiable reward", factory=RewardConfig)
    checkpoint: CheckpointConfig = knob(doc="checkpoints and resume", factory=CheckpointConfig)
    logging: LoggingConfig = knob(doc="metrics, progress and plots", factory=LoggingConfig)
    trainer: TrainerConfig = knob(doc="the RL loop", factory=TrainerConfig)
    task: ChainTaskConfig = knob(
        doc="the embedded synthetic task (reward.type=chain)", factory=ChainTaskConfig
    )
    warmstart: WarmstartConfig = knob(
        doc="supervised warm-start before RL (synthetic task)", factory=WarmstartConfig
    )
    evaluation: EvaluationConfig = knob(
        doc="held-out evaluation before and after training", factory=EvaluationConfig
    )
    callbacks: tuple[dict[str, Any], ...] = knob(
        (),
        "user callbacks: a list of {_target_: dotted.path.Class, **kwargs}; the built-in ones (the controller, "
        "DistillSparse) are built by the trainer from their sections",
    )

    def check(self) -> None:
        shape = self.model.shape()
        policy = self.policy
        for key, layout in (
            ("tensor_model_parallel_size", ParallelLayout(tp=policy.tensor_model_parallel_size)),
            ("pipeline_model_parallel_size", ParallelLayout(pp=policy.pipeline_model_parallel_size)),
        ):
            try:
                layout.validate(shape)
            except LayoutError as exc:
                raise self.invalid(f"policy.{key}", f"a size that splits the model ({exc})") from None
        if self.sparsity.dense_layers > shape.num_layers:
            raise self.invalid("sparsity.dense_layers", f"<= the model's {shape.num_layers} layers")
        try:  # the warm-start's own sizes (warmstart.num_hops / num_nodes) with the task's names
            build_tasks(self.task, self.warmstart)
        except ValueError as exc:
            raise self.invalid("warmstart.num_hops", f"sizes that make a valid task ({exc})") from None
        context = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if context > shape.max_position_embeddings:
            raise self.invalid(
                "rollout.max_new_tokens",
                f"<= {shape.max_position_embeddings - self.data.max_prompt_tokens} (data.max_prompt_tokens "
                f"+ rollout.max_new_tokens must fit the model's {shape.max_position_embeddings} positions)",
            )
        if self.rollout.prefill_chunk_tokens % self.sparsity.page_size:
            raise self.invalid(
                "rollout.prefill_chunk_tokens", f"a multiple of sparsity.page_size={self.sparsity.page_size}"
            )
        engine_tp = self.rollout.tensor_parallel_size
        if engine_tp > 1 and self.rollout.backend == "trtllm":
            raise self.invalid(
                "rollout.tensor_parallel_size",
                "1 with rollout.backend=trtllm (its engines run one per GPU; tensor-parallel engines are the torch "
                "backend's)",
            )
        if policy.tensor_model_parallel_size % engine_tp:
            raise self.invalid(
                "rollout.tensor_parallel_size",
                f"a divisor of policy.tensor_model_parallel_size={policy.tensor_model_parallel_size} "
                "(an engine spans tensor-parallel ranks of one policy replica)",
            )
        if self.rollout.backend == "trtllm" and self.trainer.device == "cpu":
            raise self.invalid("rollout.backend", "torch when trainer.device=cpu (TensorRT-LLM needs CUDA)")
        if self.distill.enabled and self.sparsity.build_schedule().is_dense:
            raise self.invalid(
                "distill.enabled", "false when the rollout schedule is dense (nothing to distill)"
            )
        if self.reward.type != SYNTHETIC_REWARD and self.data.train_path is None:
            raise self.invalid(
                "data.train_path",
                f"a prompt file for reward.type={self.reward.type} (only the synthetic task, reward.type="
                f"{SYNTHETIC_REWARD}, makes its own prompts)",
            )
        if self.control.calibrate and self.reward.type != SYNTHETIC_REWARD and self.data.val_path is None:
            raise self.invalid(
                "data.val_path",
                "a held-out prompt file when control.calibrate=true (the calibration never uses training "
                "prompts), or control.calibrate=false",
            )
        s = self.sparsity
        bad = [b for b in self.control.calibration.candidate_budgets if b % s.page_size or b < s.min_budget]
        if bad:
            raise self.invalid(
                "control.calibration.candidate_budgets",
                f"multiples of sparsity.page_size={s.page_size} that are >= {s.min_budget} tokens, but got {bad[0]}",
            )
        for i, spec in enumerate(self.callbacks):
            self._check_callback(i, spec)

    def _check_callback(self, index: int, spec: Mapping[str, Any]) -> None:
        """A ``callbacks`` entry names an importable class that is not one the trainer builds itself."""
        target = spec.get("_target_")
        if not isinstance(target, str) or not _DOTTED.match(target):
            raise self.invalid(
                f"callbacks.{index}",
                "a mapping with _target_: a dotted import path (e.g. my_package.callbacks.MyCallback) and "
                "keyword arguments",
            )
        module_name, _, attr = target.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise self.invalid(f"callbacks.{index}._target_", f"an importable class ({exc})") from None
        built_in = getattr(cls, "built_in", None)  # the trainer's own components name their section
        if isinstance(built_in, str):
            raise self.invalid(
                f"callbacks.{index}._target_",
                f"a user callback: the trainer builds {attr} itself from the {built_in}; remove it from callbacks",
            )

    # ----- output ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, not tuples) that :func:`from_dict` and recipe files accept."""
        return compose.plain(self)

    def to_yaml(self) -> str:
        """YAML text of :meth:`to_dict` in field order; a valid recipe on its own."""
        return dump_yaml(self.to_dict())

    def hashed_dict(self) -> dict[str, Any]:
        """Plain nested dict of the fields that change what a run computes (``hashed`` fields)."""
        return compose.hashed_view(self)

    def hash(self) -> str:
        """Stable 16-hex-digit SHA-256 of :meth:`hashed_dict`."""
        return compose.stable_hash(self)


def load_config(config: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> SparrowConfig:
    """Resolve a recipe (path, shipped name, or None = ``tiny_cpu``) plus ``key=value`` overrides.

    Raises :class:`~sparrow_nemo.config.ConfigError` (one line) on any problem.
    """
    return compose.load(SparrowConfig, config, overrides)


def from_dict(data: Mapping[str, Any], origin: str = "<dict>") -> SparrowConfig:
    """A config from a plain mapping (e.g. :meth:`SparrowConfig.to_dict` output) over the defaults."""
    return compose.from_dict(SparrowConfig, data, origin)
