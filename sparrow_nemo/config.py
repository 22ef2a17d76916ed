"""Recipe configuration: typed sections, YAML recipes with ``defaults:`` inheritance, overrides.

A recipe is a YAML file whose top-level keys are the sections of :class:`SparrowConfig`. It may
start with ``defaults: [base, other]``: those recipes (names relative to the recipe's folder,
``.yaml`` optional) are loaded first, in order, and the recipe's own keys are deep-merged on top.
Command-line overrides follow the NeMo/Hydra convention:

- ``a.b=value``   sets a key that exists (a section field, or a key already in a free-form mapping);
- ``+a.b=value``  adds a key that does not exist yet (free-form mappings: reward options, callbacks);
- ``++a.b=value`` adds or sets.

Values parse as YAML scalars or flow collections (``[1, 2]``, ``null``, ``true``, ``{k: v}``).
Every value is then checked against the dataclass type hints, per-field ranges and cross-field
rules. Any problem raises :class:`ConfigError`, whose message is one line naming the key path,
the value, where it came from (file or command line) and what is allowed::

    config error: unknown key 'sparsity.treshold' (from command line) - did you mean 'sparsity.threshold'?
    config error: sparsity.threshold=1.5 (from recipes/x.yaml) - expected a number in (0, 1)

The defaults of the dataclasses are the tiny CPU run (``recipes/tiny_cpu.yaml`` states them
explicitly); paper-scale values live in ``recipes/base.yaml`` and the ``qwen3_*`` recipes.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import itertools
import json
import os
import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

import sparrow_nemo
from sparrow_nemo.model_shapes import PRESETS, Qwen3Shape

__all__ = [
    "DEFAULT_RECIPE",
    "CalibrationConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "EvaluationConfig",
    "GrpoConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "Override",
    "PolicyConfig",
    "RewardConfig",
    "RolloutConfig",
    "SparrowConfig",
    "SparsityConfig",
    "TaskConfig",
    "TrainerConfig",
    "WarmstartConfig",
    "from_dict",
    "load_config",
    "recipes_dir",
    "resolve_recipe",
]

#: The recipe ``load_config(None)`` and ``sparrow train`` (no --config) use.
DEFAULT_RECIPE = "tiny_cpu"
_COMMAND_LINE = "command line"
_BUILT_IN = "built-in defaults"


class ConfigError(ValueError):
    """A recipe, override or value is invalid. ``str(err)`` is one line starting with 'config error:'."""

    def __init__(self, message: str) -> None:
        super().__init__("config error: " + " ".join(message.split()))


# =========================================================================================
# Field checks: ``check(value, type_words)`` returns None when the value passes, otherwise the
# words after "expected" (e.g. "a number in (0, 1)"); ``type_words`` describes the field's type.
# =========================================================================================
Check = Callable[[Any, str], "str | None"]


def _interval(
    lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
) -> Check:
    """Numbers in an interval; ``None`` = unbounded on that side."""
    if lo is not None and hi is not None:
        allowed = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        allowed = f"{'>' if lo_open else '>='} {lo:g}"
    else:
        allowed = f"{'<' if hi_open else '<='} {hi:g}"

    def ok(x: float) -> bool:
        above = lo is None or (x > lo if lo_open else x >= lo)
        below = hi is None or (x < hi if hi_open else x <= hi)
        return above and below

    def check(value: Any, type_words: str) -> str | None:
        values = value if isinstance(value, tuple) else (value,)
        if all(ok(x) for x in values):
            return None
        return f"{type_words} {allowed}" if not isinstance(value, tuple) else f"{type_words}, each {allowed}"

    return check


def _registered(lookup: Callable[[], Callable[[str], object]]) -> Check:
    """A name a registry accepts; ``lookup()`` returns the registry's getter, which raises
    ``KeyError("unknown ... 'x'; known: a, b")`` for an unknown name (imported lazily)."""

    def check(value: Any, type_words: str) -> str | None:
        try:
            lookup()(value)
        except (KeyError, ValueError) as exc:
            message = str(exc.args[0]) if exc.args else ""
            known = message.split("known:", 1)[-1].strip() if "known:" in message else ""
            names = [n.strip() for n in known.split(",") if n.strip()]
            return f"a registered name ({known or message}){_suggest(value, names)}"
        return None

    return check


def _matching(pattern: str, allowed: str) -> Check:
    """Strings that match the regular expression ``pattern``."""
    regex = re.compile(pattern)

    def check(value: Any, type_words: str) -> str | None:
        return None if regex.match(value) else f"{type_words} {allowed}"

    return check


def _one_of(options: tuple[str, ...], renamed: Mapping[str, str]) -> Check:
    """One of ``options``; an old name in ``renamed`` (old -> new) gets an error naming its new name."""

    def check(value: Any, type_words: str) -> str | None:
        if value in options:
            return None
        hint = (
            f" ('{value}' was renamed '{renamed[value]}')" if value in renamed else _suggest(value, options)
        )
        return f"one of {_choices(options)}{hint}"

    return check


POSITIVE = _interval(lo=0, lo_open=True)
NON_NEGATIVE = _interval(lo=0)
AT_LEAST_ONE = _interval(lo=1)
OPEN_UNIT = _interval(0, 1, lo_open=True, hi_open=True)
UNIT = _interval(0, 1)


def _field(default: Any, *, check: Check | None = None, hashed: bool = True) -> Any:
    """A dataclass field with an optional value check (see :data:`Check`).

    ``hashed=False`` leaves the field out of :meth:`SparrowConfig.hash` (fields that do not change
    what a run computes: step limits, logging, checkpoint cadence).
    """
    return field(default=default, metadata={"check": check, "hashed": hashed})


class _Problem(Exception):
    """Raised by a section's ``check()``: ``key`` (dotted, relative to the section) breaks a rule."""

    def __init__(self, key: str, expected: str) -> None:
        super().__init__(key, expected)
        self.key = key
        self.expected = expected


# =========================================================================================
# Sections
# =========================================================================================
@dataclass(frozen=True)
class ModelConfig:
    """The Qwen3 architecture and its weights."""

    #: shape preset from sparrow_nemo.model_shapes.PRESETS; null = give every shape field in shape_overrides
    preset: str | None = "tiny"
    #: Qwen3Shape fields that replace the preset's (e.g. {num_layers: 2}); add keys with ++
    shape_overrides: dict[str, Any] = field(default_factory=dict)
    #: Hugging Face Qwen3 checkpoint directory (config.json + safetensors); null = random init
    hf_checkpoint: str | None = None
    #: dtype of the weights the rollout engine holds
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"

    def shape(self) -> Qwen3Shape:
        """The resolved :class:`Qwen3Shape` (preset plus overrides)."""
        if self.preset is None:
            return Qwen3Shape(**self.shape_overrides)
        return PRESETS[self.preset.lower()].replace(**self.shape_overrides)

    def check(self) -> None:
        if self.preset is not None and self.preset.lower() not in PRESETS:
            raise _Problem("preset", f"one of {_choices(PRESETS)}{_suggest(self.preset, PRESETS)}")
        hints = get_type_hints(Qwen3Shape)
        shape_fields = [f.name for f in dataclasses.fields(Qwen3Shape)]
        for key, value in self.shape_overrides.items():
            if key not in hints:
                raise _Problem(
                    f"shape_overrides.{key}",
                    f"a Qwen3Shape field ({', '.join(shape_fields)}){_suggest(key, shape_fields)}",
                )
            try:
                _convert(hints[key], value, (), _Sources())
            except ConfigError:
                raise _Problem(f"shape_overrides.{key}", _describe(hints[key])) from None
        if self.preset is None:
            required = [f.name for f in dataclasses.fields(Qwen3Shape) if f.default is dataclasses.MISSING]
            missing = [name for name in required if name not in self.shape_overrides]
            if missing:
                raise _Problem(
                    "shape_overrides",
                    f"every required Qwen3Shape field when preset=null; missing: {', '.join(missing)}",
                )
        try:
            self.shape()
        except ValueError as exc:
            raise _Problem("shape_overrides", f"a valid Qwen3Shape ({exc})") from exc


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam(W) for the policy (field names of sparrow_nemo.policy.optim.OptimizerSettings)."""

    #: peak learning rate
    lr: float = _field(1e-3, check=POSITIVE)
    #: Adam beta1, beta2
    betas: tuple[float, ...] = _field((0.9, 0.999), check=_interval(0, 1, hi_open=True))
    #: Adam epsilon
    eps: float = _field(1e-8, check=POSITIVE)
    #: decoupled weight decay (not applied to 1-D weights: the norms)
    weight_decay: float = _field(0.01, check=NON_NEGATIVE)
    #: clip the global gradient L2 norm to this; 0 = off
    grad_clip: float = _field(1.0, check=NON_NEGATIVE)
    #: megatron's distributed optimizer on GPU (optimizer state sharded over data-parallel ranks)
    distributed: bool = True

    def check(self) -> None:
        if len(self.betas) != 2:
            raise _Problem("betas", "two numbers [beta1, beta2]")


@dataclass(frozen=True)
class PolicyConfig:
    """The trained policy: megatron-core parallel layout, batching, precision and optimizer."""

    #: tensor-parallel ranks (must divide the query and KV head counts)
    tensor_model_parallel_size: int = _field(1, check=AT_LEAST_ONE)
    #: pipeline stages (must divide the layer count)
    pipeline_model_parallel_size: int = _field(1, check=AT_LEAST_ONE)
    #: data-parallel ranks; null = world size / (tensor x pipeline)
    data_parallel_size: int | None = _field(None, check=AT_LEAST_ONE)
    #: sequences per forward/backward micro-batch (rows are cut to the micro-batch's longest sequence)
    micro_batch_size: int = _field(4, check=AT_LEAST_ONE)
    #: token budget per micro-batch instead of a row count: rows sorted by length, each micro-batch
    #: rows x its longest row <= this (sparrow_nemo.policy.packing); null = micro_batch_size rows
    max_tokens_per_micro_batch: int | None = _field(None, check=AT_LEAST_ONE)
    #: training compute precision (bf16/fp16 keep fp32 master weights)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: Megatron sequence parallelism (needs tensor_model_parallel_size > 1)
    sequence_parallel: bool = False
    #: megatron activation recomputation: full (each layer's input kept, the layer recomputed in
    #: backward), selective (the MLP recomputed), or none
    recompute_granularity: Literal["none", "full", "selective"] = "none"
    #: full recompute: uniform (every layer, in groups of recompute_num_layers) or block (only the first
    #: recompute_num_layers layers of each pipeline stage)
    recompute_method: Literal["uniform", "block"] = "uniform"
    #: full recompute: layers per recomputed group (uniform) or recomputed layers per stage (block)
    recompute_num_layers: int = _field(1, check=AT_LEAST_ONE)
    #: positions per chunk of the fused output layer + logprobs/entropy/top-k: the [chunk, vocab / tp]
    #: fp32 logits are the largest transient of a step (sparrow_nemo.policy.logprobs)
    logprob_chunk_tokens: int = _field(4096, check=AT_LEAST_ONE)
    #: optimizer settings
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def check(self) -> None:
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise _Problem("sequence_parallel", "false unless tensor_model_parallel_size > 1")


@dataclass(frozen=True)
class SpeculativeRolloutConfig:
    """Speculative rollout (rollout.mode=speculative): sparse drafts, dense verify (sparrow_nemo.rollout.spec_rollout)."""

    #: k, draft tokens per dense verify in every bin until the first re-plan (0 = plain dense decoding)
    draft_tokens: int = _field(4, check=NON_NEGATIVE)
    #: the largest k the planner may pick
    max_draft_tokens: int = _field(8, check=NON_NEGATIVE)
    #: after every step, re-plan the draft budget (among sparsity.calibration.candidate_budgets) and k per bin
    #: from the acceptance measured so far, for the most predicted tokens/s (H200 cost model)
    adapt: bool = True
    #: weight of the earlier steps' acceptance in the planner's per-bin table (0 = the last step only)
    decay: float = _field(0.5, check=UNIT)

    def check(self) -> None:
        if self.draft_tokens > self.max_draft_tokens:
            raise _Problem("draft_tokens", f"<= max_draft_tokens ({self.max_draft_tokens})")


@dataclass(frozen=True)
class RolloutConfig:
    """Generation: engine, sampling and batching."""

    #: engine: torch (sparrow_nemo.rollout.torch_engine: paged KV cache, CPU or one GPU) or trtllm (cluster)
    backend: str = _field("torch", check=_one_of(("torch", "trtllm"), renamed={"reference": "torch"}))
    #: how rollouts decode: sparse (the sparsity schedule), speculative (sparse drafts verified by dense
    #: forwards: dense-distributed samples, the importance ratio exactly 1) or dense
    mode: Literal["sparse", "speculative", "dense"] = "sparse"
    #: speculative decoding's draft length and planner (rollout.mode=speculative)
    speculative: SpeculativeRolloutConfig = field(default_factory=SpeculativeRolloutConfig)
    #: response cutoff, tokens
    max_new_tokens: int = _field(64, check=AT_LEAST_ONE)
    #: sampling temperature (> 0: RL needs sampled log-probabilities)
    temperature: float = _field(1.0, check=POSITIVE)
    #: nucleus sampling mass
    top_p: float = _field(1.0, check=_interval(0, 1, lo_open=True))
    #: sample among the k most likely tokens; 0 = off
    top_k: int = _field(0, check=NON_NEGATIVE)
    #: texts that end a response once it contains them
    stop_strings: tuple[str, ...] = ()
    #: token ids that end a response; null = the model's EOS, [] = none
    stop_token_ids: tuple[int, ...] | None = _field(None, check=NON_NEGATIVE)
    #: base seed of the per-sample sampling generators
    seed: int = _field(0, check=NON_NEGATIVE)
    #: top (id, logprob) pairs returned per position (the acceptance-rate estimate uses 20)
    logprobs_topk: int = _field(20, check=AT_LEAST_ONE)
    #: sequences decoded together (the KV page pool is sized for it)
    max_batch_size: int = _field(64, check=AT_LEAST_ONE)
    #: prompt tokens per prefill chunk
    prefill_chunk_tokens: int = _field(512, check=AT_LEAST_ONE)
    #: decode attention: torch gather path, Triton kernels, or auto (Triton where it can run)
    attention_impl: Literal["auto", "torch", "triton"] = "auto"
    #: GPUs per rollout engine (engine tensor parallelism). 1 = one engine per GPU, colocated with that
    #: GPU's policy rank (the default). k > 1 (TensorRT-LLM only; must divide
    #: policy.tensor_model_parallel_size) = one engine per k consecutive tensor-parallel ranks, for a model
    #: whose weights plus a useful KV cache do not fit one GPU (sparrow_nemo.grpo.process_model)
    tensor_parallel_size: int = _field(1, check=AT_LEAST_ONE)

    def check(self) -> None:
        if self.mode == "speculative" and self.backend != "torch":
            raise _Problem(
                "mode", "sparse or dense with backend trtllm (speculative rollout runs on the torch engine)"
            )


@dataclass(frozen=True)
class CalibrationConfig:
    """The offline calibration pass that picks a schedule for ``sparsity.threshold``."""

    #: candidate budgets in tokens (reserved pages included), strictly increasing multiples of page_size
    candidate_budgets: tuple[int, ...] = (16, 24, 32, 48, 64)
    #: calibration prompts (taken from data.train_path, or the synthetic task)
    num_prompts: int = _field(16, check=AT_LEAST_ONE)
    #: sparse samples per calibration prompt (the paper: 8)
    samples_per_prompt: int = _field(8, check=AT_LEAST_ONE)


@dataclass(frozen=True)
class SparsityConfig:
    """Sparse decode attention during rollout and its schedule (METHOD.md)."""

    #: preset ('qwen3-1.7b-0.86', 'dense', 'fixed:<tokens>' in this section's pages and bins), a schedule
    #: YAML path (relative to the working directory), or 'explicit' (= budgets, bin_tokens, page_size below)
    schedule: str = "explicit"
    #: budgets per bin in tokens (reserved pages included); read only when schedule=explicit
    budgets: tuple[int, ...] | None = (16, 24, 48, 64)
    #: acceptance-rate tail to keep in every bin
    threshold: float = _field(0.86, check=OPEN_UNIT)
    #: quantile of the per-token acceptance rate that defines the tail
    quantile: float = _field(0.05, check=OPEN_UNIT)
    #: bin width in tokens of cached length (tail statistics; explicit schedules)
    bin_tokens: int = _field(16, check=AT_LEAST_ONE)
    #: tokens per KV page
    page_size: int = _field(4, check=AT_LEAST_ONE)
    #: first pages always kept (attention sink)
    sink_pages: int = _field(1, check=NON_NEGATIVE)
    #: most recent pages always kept (local window)
    local_pages: int = _field(2, check=NON_NEGATIVE)
    #: first decoder layers that stay dense
    dense_layers: int = _field(0, check=NON_NEGATIVE)
    #: run the calibration pass before training and use its schedule
    calibrate: bool = True
    #: calibration pass settings
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    #: online schedule adaptation from each step's tail: off, raise budgets, or raise and lower
    adapt: Literal["off", "raise", "raise_and_lower"] = "raise"
    #: a bin fails only when its tail is below threshold by more than this many standard errors
    #: of the quantile estimate (binomial confidence bound, TailMismatchScheduler.noise_z)
    noise_z: float = _field(2.0, check=NON_NEGATIVE)
    #: bins with fewer tokens than this in a step get no adapt decision
    min_bin_tokens: int = _field(100, check=AT_LEAST_ONE)
    #: switch to the dense schedule when reward or response length collapses with bins below threshold
    #: (TailMismatchScheduler.collapse_guard; experiments turn it off to watch a collapse happen)
    collapse_guard: bool = True

    @property
    def min_budget(self) -> int:
        """Smallest useful budget, tokens: the reserved sink and local pages plus one top-k page."""
        return (self.sink_pages + self.local_pages + 1) * self.page_size

    def build_schedule(self) -> Any:
        """The :class:`sparrow_nemo.sparse.schedule.BudgetSchedule` this section names.

        Raises ``ValueError``/``KeyError`` (from BudgetSchedule) on a bad spec, ``FileNotFoundError``
        for a missing schedule file.
        """
        from sparrow_nemo.sparse.schedule import BudgetSchedule

        spec = self.schedule.strip()
        if spec == "explicit":
            return BudgetSchedule(
                bin_tokens=self.bin_tokens,
                budgets=self.budgets or (),
                page_size=self.page_size,
                name="explicit",
            )
        if spec.endswith((".yaml", ".yml")):
            path = Path(spec)
            if not path.is_file():
                raise FileNotFoundError(f"schedule file {path} not found")
            return BudgetSchedule.from_yaml(path)
        if spec.lower().startswith("fixed:"):  # one constant budget, in this section's pages and bins
            return BudgetSchedule.from_preset(spec, self.bin_tokens, self.page_size)
        return BudgetSchedule.from_preset(spec)

    def check(self) -> None:
        if self.schedule.strip() == "explicit" and not self.budgets:
            raise _Problem("budgets", "a non-empty list of budgets (tokens) when schedule=explicit")
        try:
            schedule = self.build_schedule()
        except (ValueError, KeyError, FileNotFoundError) as exc:
            key = "budgets" if self.schedule.strip() == "explicit" else "schedule"
            raise _Problem(key, f"a valid schedule ({exc.args[0] if exc.args else exc})") from exc
        if not schedule.is_dense:
            if schedule.page_size != self.page_size:
                raise _Problem(
                    "page_size", f"the page size of schedule '{self.schedule}' ({schedule.page_size} tokens)"
                )
            small = [b for b in schedule.budgets if b < self.min_budget]
            if small:
                raise _Problem(
                    "schedule",
                    f"budgets >= {self.min_budget} tokens (sink + local pages + one "
                    f"top-k page), but '{self.schedule}' has {small[0]}",
                )
        cands = self.calibration.candidate_budgets
        if not cands:
            raise _Problem("calibration.candidate_budgets", "at least one candidate budget")
        if any(b <= a for a, b in itertools.pairwise(cands)):
            raise _Problem("calibration.candidate_budgets", "strictly increasing budgets")
        bad = [b for b in cands if b % self.page_size or b < self.min_budget]
        if bad:
            raise _Problem(
                "calibration.candidate_budgets",
                f"multiples of page_size={self.page_size} that are "
                f">= {self.min_budget} tokens, but got {bad[0]}",
            )


@dataclass(frozen=True)
class LossConfig:
    """The policy loss (field names match sparrow_nemo.grpo.losses.PolicyLossConfig)."""

    #: registered policy loss (sparrow_nemo.grpo.losses)
    name: str = _field("clipped_pg", check=_registered(lambda: _grpo_losses().get_policy_loss))
    #: PPO ratio lower clip: ratio >= 1 - clip_low
    clip_low: float = _field(0.2, check=_interval(0, 1, hi_open=True))
    #: PPO ratio upper clip: ratio <= 1 + clip_high (DAPO clip-higher)
    clip_high: float = _field(0.28, check=NON_NEGATIVE)
    #: registered aggregation (sparrow_nemo.grpo.losses.AGGREGATIONS), each normalised by the optimizer step's
    #: counts over all micro-batches and DP ranks: token_mean (token-level, the paper), seq_mean_token_mean,
    #: seq_mean_token_sum
    aggregation: str = _field("token_mean", check=_registered(lambda: _grpo_aggregation))
    #: weight of the k3 KL to the frozen reference policy (the initial weights, kept on the host); 0 = none
    kl_coef: float = _field(0.0, check=NON_NEGATIVE)
    #: rollout/train mismatch correction: none, tis, icepop, seq_mask
    correction: str = _field("tis", check=_registered(lambda: _grpo_losses().get_correction))
    #: truncated importance sampling cap on exp(train - rollout logprob)
    tis_cap: float = _field(2.0, check=POSITIVE)
    #: icepop: tokens whose ratio is below this are masked
    icepop_low: float = _field(0.5, check=NON_NEGATIVE)
    #: icepop: tokens whose ratio is above this are masked
    icepop_high: float = _field(5.0, check=POSITIVE)
    #: seq_mask: sequences whose geometric-mean ratio is below this are masked
    seq_mask_low: float = _field(0.95, check=NON_NEGATIVE)
    #: seq_mask: sequences whose geometric-mean ratio is above this are masked
    seq_mask_high: float = _field(1.05, check=POSITIVE)

    def check(self) -> None:
        if self.clip_high < self.clip_low:
            raise _Problem("clip_high", f">= clip_low ({self.clip_low:g})")
        for what in ("icepop", "seq_mask"):
            low, high = getattr(self, f"{what}_low"), getattr(self, f"{what}_high")
            if high <= low:
                raise _Problem(f"{what}_high", f"> {what}_low ({low:g})")


@dataclass(frozen=True)
class GrpoConfig:
    """The GRPO algorithm."""

    #: prompts sampled per RL step
    prompts_per_step: int = _field(16, check=AT_LEAST_ONE)
    #: samples per prompt (the group; the paper: 8)
    samples_per_prompt: int = _field(8, check=_interval(lo=2))
    #: registered advantage estimator (sparrow_nemo.grpo.advantages): grpo, rloo (leave-one-out)
    adv_estimator: str = _field("grpo", check=_registered(lambda: _grpo_advantages().get_advantage))
    #: divide group-centred rewards by the group std (grpo estimator)
    normalize_std: bool = True
    #: optimizer steps per RL step: the step's samples in this many mini-batches, old logprobs computed once
    #: before the first (1 = on-policy: PPO ratio exactly 1, the clip never acts; > 1: ratio and clip are real)
    mini_batches_per_step: int = _field(2, check=AT_LEAST_ONE)
    #: the policy loss
    loss: LossConfig = field(default_factory=LossConfig)


@dataclass(frozen=True)
class DistillConfig:
    """DistillSparse: a LoRA adapter used only by the sparse rollout engine."""

    #: train the rollout-only LoRA each step
    enabled: bool = False
    #: LoRA rank
    lora_rank: int = _field(8, check=AT_LEAST_ONE)
    #: LoRA alpha (scaling = alpha / rank)
    lora_alpha: float = _field(16.0, check=POSITIVE)
    #: HF Qwen3 linear names that get an adapter (default: all of them, as in the paper)
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    #: LoRA learning rate = policy.optimizer.lr x this
    lr_multiplier: float = _field(5.0, check=POSITIVE)
    #: LoRA updates per RL step
    steps: int = _field(1, check=AT_LEAST_ONE)
    #: weight of KL(sparse || dense) (k3 estimator on the sampled tokens)
    kl_coef: float = _field(1.0, check=NON_NEGATIVE)
    #: weight of the sparse policy-gradient loss (same advantages as the policy step)
    pg_coef: float = _field(1.0, check=NON_NEGATIVE)
    #: clip the adapter gradient's global L2 norm to this; 0 = off
    grad_clip: float = _field(1.0, check=NON_NEGATIVE)
    #: seed of the adapter initialisation and of the probe rollouts' sampling
    seed: int = _field(0, check=NON_NEGATIVE)

    def check(self) -> None:
        from sparrow_nemo.rollout.qwen3_torch import ATTN_LINEARS, MLP_LINEARS

        allowed = ATTN_LINEARS + MLP_LINEARS
        if not self.target_modules:
            raise _Problem("target_modules", f"at least one of {_choices(allowed)}")
        for i, name in enumerate(self.target_modules):
            if name not in allowed:
                raise _Problem(f"target_modules.{i}", f"one of {_choices(allowed)}{_suggest(name, allowed)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise _Problem("target_modules", "each module named once")
        if self.enabled and self.kl_coef == 0 and self.pg_coef == 0:
            raise _Problem("kl_coef", "> 0 or pg_coef > 0 (with both 0 the adapter never learns)")


_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz")


@dataclass(frozen=True)
class DataConfig:
    """Training prompts. File existence is checked when the data is read, not at load time."""

    #: JSONL / JSON / Parquet prompts; null = the embedded synthetic task
    train_path: str | None = None
    #: prompts for `sparrow eval`; null = none
    val_path: str | None = None
    #: field holding the prompt text
    prompt_key: str = "problem"
    #: field holding the reference answer
    answer_key: str = "answer"
    #: longer prompts are skipped as bad rows
    max_prompt_tokens: int = _field(256, check=AT_LEAST_ONE)
    #: the run fails when more than this fraction of rows is bad
    max_bad_fraction: float = _field(0.01, check=UNIT)
    #: shuffle prompts each epoch (seeded by trainer.seed)
    shuffle: bool = True

    def check(self) -> None:
        for key in ("train_path", "val_path"):
            path = getattr(self, key)
            if path is not None and not path.lower().endswith(_DATA_SUFFIXES):
                raise _Problem(key, f"a file ending in {', '.join(_DATA_SUFFIXES)}")


@dataclass(frozen=True)
class RewardConfig:
    """The verifiable reward."""

    #: synthetic (the embedded toy task), math (answer verification), code (sandboxed tests)
    type: Literal["synthetic", "math", "code"] = "synthetic"
    #: options passed to the reward / task (free-form; add keys with ++reward.options.key=value)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints (none of these fields enters the config hash)."""

    #: save checkpoints at all
    enabled: bool = _field(True, hashed=False)
    #: folder; null = <run_dir>/checkpoints
    dir: str | None = _field(None, hashed=False)
    #: save every N steps (and at the end)
    every_n_steps: int = _field(10, check=AT_LEAST_ONE, hashed=False)
    #: also save when this many minutes passed since the last save (rank 0's clock decides for all ranks),
    #: so a preempted multi-hour attempt always has a recent checkpoint; 0 = off
    every_n_minutes: float = _field(0.0, check=NON_NEGATIVE, hashed=False)
    #: checkpoints kept on disk
    keep_last: int = _field(2, check=AT_LEAST_ONE, hashed=False)
    #: auto (latest good one in dir if any, else a fresh run), never, or a checkpoint path
    resume: str = _field("auto", hashed=False)
    #: resume into a run folder whose config_hash.txt differs from this recipe's hash
    force_resume: bool = _field(False, hashed=False)


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics and plots (none of these fields enters the config hash)."""

    #: run folder (config, metrics, plots); null = runs/<name>
    run_dir: str | None = _field(None, hashed=False)
    #: metrics as JSON lines in <run_dir>/metrics.jsonl
    jsonl: bool = _field(True, hashed=False)
    #: TensorBoard event files (needs the tensorboard package)
    tensorboard: bool = _field(False, hashed=False)
    #: a progress bar on the terminal
    progress_bar: bool = _field(True, hashed=False)
    #: PNG plots in <run_dir>/plots at the end
    plots: bool = _field(True, hashed=False)
    #: log metrics every N steps
    log_every_n_steps: int = _field(1, check=AT_LEAST_ONE, hashed=False)


@dataclass(frozen=True)
class TaskConfig:
    """The embedded synthetic task (reward.type=synthetic): chain following, sparrow_nemo.tasks.chain."""

    #: (min, max) table entries per problem (at most 26 ** name_length: 26 with one-letter names)
    num_nodes: tuple[int, ...] = _field((2, 4), check=_interval(2, 26**3))
    #: (min, max) pointer hops on the queried chain (the response grows by 2 * name_length + 4 characters per hop)
    num_hops: tuple[int, ...] = _field((1, 2), check=AT_LEAST_ONE)
    #: problems are a pure function of (seed, index)
    seed: int = _field(0, check=NON_NEGATIVE)
    #: letters per node name: 1 = single letters (at most 26 nodes), 2 = two-letter names (chains of hundreds)
    name_length: int = _field(1, check=_interval(1, 3))
    #: size of the names' alphabet: 26 = A-Z; more adds non-ASCII letters (sparrow_nemo.tasks.tokenizer:
    #: one token each, two ids per letter, so the model's vocab_size must hold 80 + 2 * (letters - 26) ids)
    letters: int = _field(26, check=_interval(26, 451))

    def check(self) -> None:
        from sparrow_nemo.tasks.chain import ChainTaskConfig

        for key in ("num_nodes", "num_hops"):
            value = getattr(self, key)
            if len(value) != 2 or value[0] > value[1]:
                raise _Problem(key, "two integers [min, max] with min <= max")
        try:
            ChainTaskConfig(
                num_nodes=tuple(self.num_nodes),
                num_hops=tuple(self.num_hops),
                seed=self.seed,
                name_length=self.name_length,
                letters=self.letters,
            )
        except ValueError as exc:
            raise _Problem("num_hops", f"a valid task size ({exc})") from None


@dataclass(frozen=True)
class WarmstartConfig:
    """Supervised warm-start on the task's reference solutions before RL (synthetic task only).

    The result is cached as an HF checkpoint under ``<cache_dir>/<hash>/`` (hash of the model, the task
    and these settings), so a second run skips it.
    """

    #: run the warm-start (ignored when model.hf_checkpoint is given)
    enabled: bool = True
    #: optimizer steps
    steps: int = _field(1200, check=AT_LEAST_ONE)
    #: (prompt, solution) pairs per step
    batch_size: int = _field(16, check=AT_LEAST_ONE)
    #: learning rate, constant (the other optimizer settings come from policy.optimizer)
    lr: float = _field(5e-3, check=POSITIVE)
    #: (min, max) hops of the warm-start problems; null = task.num_hops. Shorter than the task's = a
    #: curriculum: RL then meets longer chains than the warm-start saw (sparrow_nemo.tasks.build_tasks)
    num_hops: tuple[int, ...] | None = None
    #: (min, max) table entries of the warm-start problems; null = task.num_nodes
    num_nodes: tuple[int, ...] | None = None
    #: steps over which the warm-start problems grow (geometrically) from the ranges' minimum to their full
    #: sizes (0 = none): a small model finds the table look-up on small tables first (sparrow_nemo.tasks.chain)
    ramp_steps: int = _field(0, check=NON_NEGATIVE)

    def check(self) -> None:
        for key in ("num_hops", "num_nodes"):
            value = getattr(self, key)
            if value is not None and (len(value) != 2 or value[0] > value[1] or value[0] < 1):
                raise _Problem(key, "null or two integers [min, max] with 1 <= min <= max")

    #: cache folder; null = ~/.cache/sparrow_nemo/warmstart (or $SPARROW_CACHE/warmstart)
    cache_dir: str | None = _field(None, hashed=False)


@dataclass(frozen=True)
class EvaluationConfig:
    """The held-out evaluation before and after training (the run summary's accuracy and speedup)."""

    #: held-out prompts, one sample each (synthetic task: unseen problems; a file: its first rows)
    num_prompts: int = _field(256, check=AT_LEAST_ONE, hashed=False)


@dataclass(frozen=True)
class TrainerConfig:
    """The RL loop."""

    #: RL steps to run (not hashed: a run may be extended)
    max_steps: int = _field(40, check=AT_LEAST_ONE, hashed=False)
    #: global seed (data order, initialisation)
    seed: int = _field(0, check=NON_NEGATIVE)
    #: where to run; auto = cuda when available
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: torch intra-op threads when running on the CPU (0 = torch's default, one per core). 1 is the
    #: fastest for the tiny models (their matmuls are too small to split) and avoids OpenMP threads
    #: spinning against other processes on a busy machine (measured 10-20x slower with 2 threads there)
    cpu_threads: int = _field(1, check=NON_NEGATIVE, hashed=False)
    #: abort the run after this many steps in a row whose update was skipped for a NaN/inf loss or gradient
    max_consecutive_nonfinite: int = _field(3, check=AT_LEAST_ONE, hashed=False)
    #: timeout of every collective (torch.distributed.init_process_group), minutes. A rank that finished its
    #: rollout waits in the next collective for the slowest one: 60 covers a 40K-token rollout at a
    #: pessimistic 50 ms per decode step (34 min) with room; NCCL's own default (10 min) does not
    dist_timeout_minutes: float = _field(60.0, check=POSITIVE, hashed=False)


_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


@dataclass(frozen=True)
class SparrowConfig:
    """A resolved recipe: every section typed and validated."""

    #: run name (letters, digits, . _ -); the default run folder is runs/<name>
    name: str = _field(
        "tiny_cpu", check=_matching(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", "of letters, digits, . _ -")
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    #: callbacks: a list of {_target_: dotted.path.Class, **kwargs}
    callbacks: tuple[dict[str, Any], ...] = ()

    def check(self) -> None:
        from sparrow_nemo.policy.parallel import LayoutError, ParallelLayout

        shape = self.model.shape()
        policy = self.policy
        for key, layout in (
            ("tensor_model_parallel_size", ParallelLayout(tp=policy.tensor_model_parallel_size)),
            ("pipeline_model_parallel_size", ParallelLayout(pp=policy.pipeline_model_parallel_size)),
        ):
            try:
                layout.validate(shape)
            except LayoutError as exc:
                raise _Problem(f"policy.{key}", f"a size that splits the model ({exc})") from None
        if self.sparsity.dense_layers > shape.num_layers:
            raise _Problem("sparsity.dense_layers", f"<= the model's {shape.num_layers} layers")
        context = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        if context > shape.max_position_embeddings:
            raise _Problem(
                "rollout.max_new_tokens",
                f"<= {shape.max_position_embeddings - self.data.max_prompt_tokens} (data.max_prompt_tokens "
                f"+ rollout.max_new_tokens must fit the model's {shape.max_position_embeddings} positions)",
            )
        engine_tp = self.rollout.tensor_parallel_size
        if engine_tp > 1 and self.rollout.backend != "trtllm":
            raise _Problem(
                "rollout.tensor_parallel_size",
                "1 with rollout.backend=torch (the torch engine runs on one GPU)",
            )
        if policy.tensor_model_parallel_size % engine_tp:
            raise _Problem(
                "rollout.tensor_parallel_size",
                f"a divisor of policy.tensor_model_parallel_size={policy.tensor_model_parallel_size} "
                "(an engine spans tensor-parallel ranks of one policy replica)",
            )
        if self.rollout.backend == "trtllm" and self.trainer.device == "cpu":
            raise _Problem("rollout.backend", "torch when trainer.device=cpu (TensorRT-LLM needs CUDA)")
        if self.distill.enabled and self.sparsity.build_schedule().is_dense:
            raise _Problem("distill.enabled", "false when the rollout schedule is dense (nothing to distill)")
        if self.reward.type != "synthetic" and self.data.train_path is None:
            raise _Problem(
                "data.train_path",
                f"a prompt file for reward.type={self.reward.type} "
                "(only the synthetic task makes its own prompts)",
            )
        for i, spec in enumerate(self.callbacks):
            target = spec.get("_target_")
            if not isinstance(target, str) or not _DOTTED.match(target):
                raise _Problem(
                    f"callbacks.{i}",
                    "a mapping with _target_: a dotted import path "
                    "(e.g. sparrow_nemo.callbacks.TailMismatchScheduler) and keyword arguments",
                )

    # ----- output ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, not tuples) that :func:`from_dict` and recipe files accept."""
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        """YAML text of :meth:`to_dict` in field order; a valid recipe on its own."""
        return yaml.dump(self.to_dict(), Dumper=_RecipeDumper, sort_keys=False, width=110)

    def hashed_dict(self) -> dict[str, Any]:
        """Plain nested dict of the fields that change what a run computes (``hashed`` fields)."""
        return _hashed_view(self)

    def hash(self) -> str:
        """Stable 16-hex-digit SHA-256 of :meth:`hashed_dict`."""
        text = json.dumps(self.hashed_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class _RecipeDumper(yaml.SafeDumper):
    """Block-style mappings; lists of scalars on one line (``[64, 96, 128]``)."""

    def represent_list(self, data: list[Any]) -> yaml.Node:
        flow = all(not isinstance(v, dict | list) for v in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_RecipeDumper.add_representer(list, _RecipeDumper.represent_list)


def _grpo_losses() -> types.ModuleType:
    from sparrow_nemo.grpo import losses

    return losses


def _grpo_advantages() -> types.ModuleType:
    from sparrow_nemo.grpo import advantages

    return advantages


def _grpo_aggregation(name: str) -> None:
    """Registry-style lookup of a loss aggregation mode (KeyError lists the known ones)."""
    known = _grpo_losses().AGGREGATIONS
    if name not in known:
        raise KeyError(f"unknown aggregation '{name}'; known: {', '.join(known)}")


# =========================================================================================
# Small helpers
# =========================================================================================
def _choices(options: Iterable[str]) -> str:
    return ", ".join(f"'{o}'" for o in options)


def _suggest(word: str, options: Iterable[str]) -> str:
    """`` - did you mean 'x'?`` for the closest option, or ''."""
    match = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.7)
    return f" - did you mean '{match[0]}'?" if match else ""


def _fmt(value: Any) -> str:
    """A value as it would be typed on the command line."""
    if isinstance(value, str):
        return value
    return json.dumps(_plain(value), default=str)


def _plain(value: Any) -> Any:
    """Tuples -> lists, recursively (YAML/JSON friendly)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _hashed_view(obj: Any) -> Any:
    """The dataclass tree as plain data, without fields marked ``hashed=False``."""
    if dataclasses.is_dataclass(obj):
        return {
            f.name: _hashed_view(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.metadata.get("hashed", True)
        }
    return _plain(obj)


def _dotted(path: Sequence[str]) -> str:
    return ".".join(path)


# =========================================================================================
# Provenance: which file (or the command line) set each key
# =========================================================================================
class _Sources:
    """Key path -> origin; a path without its own entry inherits its nearest ancestor's."""

    def __init__(self) -> None:
        self._by_path: dict[tuple[str, ...], str] = {(): _BUILT_IN}

    def mark(self, path: tuple[str, ...], origin: str) -> None:
        """``path`` and everything below it now come from ``origin``."""
        n = len(path)
        for key in [p for p in self._by_path if len(p) > n and p[:n] == path]:
            del self._by_path[key]
        self._by_path[path] = origin

    def of(self, path: Sequence[str]) -> str:
        """Who set ``path``: the latest mark at or below it, else its nearest marked ancestor."""
        path = tuple(path)
        n = len(path)
        below = [origin for p, origin in self._by_path.items() if len(p) >= n and p[:n] == path]
        if below:
            return below[-1]
        for m in range(n - 1, -1, -1):
            if path[:m] in self._by_path:
                return self._by_path[path[:m]]
        return _BUILT_IN


def _value_error(path: Sequence[str], value: Any, expected: str, sources: _Sources) -> ConfigError:
    return ConfigError(f"{_dotted(path)}={_fmt(value)} (from {sources.of(path)}) - expected {expected}")


def _unknown_key(
    path: Sequence[str], options: Iterable[str], rest: Sequence[str], origin: str, hint: str = ""
) -> ConfigError:
    """'unknown key a.b' with a full-path suggestion (the misspelled segment replaced) or the options."""
    options = [str(o) for o in options]
    match = difflib.get_close_matches(str(path[-1]), options, n=1, cutoff=0.7)
    where = f"unknown key '{_dotted([*path, *rest])}' (from {origin})"
    if match:
        return ConfigError(f"{where} - did you mean '{_dotted([*path[:-1], match[0], *rest])}'?")
    parent = f"under '{_dotted(path[:-1])}'" if len(path) > 1 else "at the top level"
    return ConfigError(f"{where} - allowed keys {parent}: {', '.join(options) or '(none)'}{hint}")


# =========================================================================================
# Typed conversion (dataclass type hints)
# =========================================================================================
def _describe(tp: Any) -> str:
    """Words for a type: 'an integer', 'a list of integers or null', ..."""
    origin = get_origin(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is Any:
        return "any value"
    if origin is Literal:
        return f"one of {_choices(get_args(tp))}"
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) if a is not type(None) else "null" for a in get_args(tp))
    if origin is tuple:
        item = get_args(tp)[0]
        plural = {int: "integers", float: "numbers", str: "strings"}.get(item)
        return f"a list of {plural}" if plural else f"a list (each {_describe(item)})"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _non_null(tp: Any) -> Any:
    """``X`` for ``X | None``; other types unchanged."""
    if get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else tp
    return tp


def _convert(tp: Any, value: Any, path: tuple[str, ...], sources: _Sources, words: str = "") -> Any:
    """``value`` checked and converted to ``tp``; ConfigError naming ``path`` otherwise.

    ``words`` replaces the type description in the error (an Optional field passes its own).
    """
    origin = get_origin(tp)
    words = words or _describe(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, sources)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"config schema: unsupported union {tp} at {_dotted(path)}")
        if value is None:
            raise _value_error(path, value, words, sources)
        return _convert(inner[0], value, path, sources, words)
    if origin is Literal:
        if value not in get_args(tp):
            raise _value_error(path, value, words + _suggest(value, get_args(tp)), sources)
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _value_error(path, value, words, sources)
        return tuple(_convert(get_args(tp)[0], v, (*path, str(i)), sources) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _value_error(path, value, "a mapping with string keys", sources)
        return {k: _convert(get_args(tp)[1], v, (*path, k), sources) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _value_error(path, value, words, sources)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _value_error(path, value, words, sources)
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            return float(value)  # YAML 1.1 reads '1e-3' (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _value_error(path, value, words, sources)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _value_error(path, value, words, sources)
        return value
    raise TypeError(f"config schema: unsupported type {tp} at {_dotted(path)}")


def _build(cls: type, data: Any, path: tuple[str, ...], sources: _Sources) -> Any:
    """Instance of dataclass ``cls`` from mapping ``data``: unknown keys, types, ranges, ``check()``."""
    if not isinstance(data, Mapping):
        raise _value_error(path, data, f"a mapping of {cls.__name__} keys", sources)
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise _unknown_key((*path, str(key)), fields, (), sources.of((*path, str(key))))
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        value = _convert(hints[name], data[name], (*path, name), sources)
        check: Check | None = f.metadata.get("check")
        expected = check(value, _describe(_non_null(hints[name]))) if check and value is not None else None
        if expected is not None:
            raise _value_error((*path, name), data[name], expected, sources)
        kwargs[name] = value
    obj = cls(**kwargs)
    if hasattr(obj, "check"):
        try:
            obj.check()
        except _Problem as problem:
            key = (*path, *problem.key.split("."))
            raise _value_error(key, _lookup(obj, problem.key.split(".")), problem.expected, sources) from None
    return obj


def _lookup(obj: Any, keys: Sequence[str]) -> Any:
    """The value at ``keys`` below a dataclass / mapping / sequence."""
    for key in keys:
        if dataclasses.is_dataclass(obj):
            obj = getattr(obj, key)
        elif isinstance(obj, Mapping):
            obj = obj[key]
        else:
            obj = obj[int(key)]
    return obj


# =========================================================================================
# Recipe files and defaults
# =========================================================================================
def recipes_dir() -> Path:
    """The folder of the shipped recipes (next to the package)."""
    folder = Path(sparrow_nemo.__file__).resolve().parents[1] / "recipes"
    if not folder.is_dir():
        raise ConfigError(
            f"the recipes folder {folder} is missing (sparrow_nemo was installed without its "
            "recipes); pass --config PATH to a recipe file"
        )
    return folder


def _display(path: Path) -> str:
    """``path`` relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _with_suffix(name: str) -> str:
    return name if name.endswith((".yaml", ".yml")) else name + ".yaml"


def resolve_recipe(config: str | os.PathLike[str] | None) -> Path:
    """A recipe file: ``None`` -> the default recipe; an existing path; else a name in :func:`recipes_dir`."""
    if config is None:
        return recipes_dir() / _with_suffix(DEFAULT_RECIPE)
    path = Path(config)
    if path.is_file():
        return path
    shipped = recipes_dir() / _with_suffix(str(config))
    if shipped.is_file() and path.parent == Path("."):
        return shipped
    names = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
    raise ConfigError(
        f"recipe '{config}' not found (no such file, and not a shipped recipe)"
        f"{_suggest(path.stem, names)} - shipped recipes: {', '.join(names)}"
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    """A recipe file's top-level mapping; YAML errors name the file and line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read recipe {_display(path)}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"invalid YAML in {_display(path)}{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {_display(path)}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"recipe {_display(path)} must be a mapping of sections at the top level, "
            f"got {type(data).__name__}"
        )
    return data


def _merge(
    base: dict[str, Any],
    layer: Mapping[str, Any],
    sources: _Sources,
    origin: str,
    prefix: tuple[str, ...] = (),
) -> None:
    """Deep-merge ``layer`` into ``base`` in place: mappings merge, everything else replaces."""
    for key, value in layer.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value, sources, origin, path)
        else:
            base[key] = copy.deepcopy(value)
            sources.mark(path, origin)


def _compose(path: Path, tree: dict[str, Any], sources: _Sources, stack: tuple[Path, ...] = ()) -> None:
    """Merge recipe ``path`` into ``tree``: its ``defaults`` first (recursively), then its own keys."""
    resolved = path.resolve()
    if resolved in stack:
        cycle = " -> ".join(_display(p) for p in (*stack, resolved))
        raise ConfigError(f"defaults cycle: {cycle}")
    data = _read_yaml(path)
    defaults = data.pop("defaults", [])
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(
            f"defaults={_fmt(defaults)} (from {_display(path)}) - expected a list of recipe names "
            "(e.g. defaults: [base])"
        )
    for name in defaults:
        parent = path.parent / _with_suffix(name)
        if not parent.is_file():
            names = sorted(p.stem for p in path.parent.glob("*.yaml"))
            raise ConfigError(
                f"defaults entry '{name}' (from {_display(path)}) - no recipe {_display(parent)}"
                f"{_suggest(name, names)}"
            )
        _compose(parent, tree, sources, (*stack, resolved))
    _merge(tree, data, sources, _display(path))


# =========================================================================================
# Overrides
# =========================================================================================
_OVERRIDE = re.compile(r"^(?P<mode>\+{0,2})(?P<key>[\w-]+(\.[\w-]+)*)=(?P<value>.*)$", re.DOTALL)


@dataclass(frozen=True)
class Override:
    """One command-line override: ``mode`` '' (set existing), '+' (add new) or '++' (add or set)."""

    mode: str
    path: tuple[str, ...]
    value: Any

    @classmethod
    def parse(cls, text: str) -> Override:
        match = _OVERRIDE.match(text)
        if not match:
            raise ConfigError(
                f"override '{text}' (from {_COMMAND_LINE}) - expected key=value, +key=value or "
                "++key=value with a dotted key (e.g. sparsity.threshold=0.9)"
            )
        raw = match.group("value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            raise ConfigError(
                f"override '{text}' (from {_COMMAND_LINE}) - the value does not parse as YAML "
                "(quote it, e.g. key='a: b')"
            ) from None
        return cls(match.group("mode"), tuple(match.group("key").split(".")), value)


def _free_form(path: Sequence[str]) -> bool:
    """True when the schema allows new keys at ``path`` (a dict[...] field or anything below Any)."""
    tp: Any = SparrowConfig
    for key in path:
        if dataclasses.is_dataclass(tp):
            hints = get_type_hints(tp)
            if key not in hints:
                return False
            tp = hints[key]
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        elif get_origin(tp) is tuple:
            tp = get_args(tp)[0]
        else:
            return tp is Any
        if get_origin(tp) in (Union, types.UnionType):
            tp = next(a for a in get_args(tp) if a is not type(None))
    return get_origin(tp) is dict or tp is Any


def _apply(tree: dict[str, Any], ov: Override, sources: _Sources) -> None:
    """Apply one override to the merged tree (defaults + recipes), recording its source."""
    node: Any = tree
    for depth, key in enumerate(ov.path):
        here = ov.path[: depth + 1]
        last = depth == len(ov.path) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                items = f"a list of {len(node)} (indices 0..{len(node) - 1})" if node else "an empty list"
                raise ConfigError(
                    f"{_dotted(here)} (from {_COMMAND_LINE}) - '{_dotted(ov.path[:depth])}' is {items}; "
                    f"set the whole list instead ({_dotted(ov.path[:depth])}=[...])"
                )
            if last:
                node[int(key)] = ov.value
            node = node[int(key)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(
                f"{_dotted(here)} (from {_COMMAND_LINE}) - '{_dotted(ov.path[:depth])}' is "
                f"{_fmt(node)}, not a mapping"
            )
        exists = key in node
        if not exists and (ov.mode == "" or not _free_form(ov.path[:depth])):
            hint = f" (add a new key with ++{_dotted(ov.path)}=...)" if _free_form(ov.path[:depth]) else ""
            raise _unknown_key(here, node, ov.path[depth + 1 :], _COMMAND_LINE, hint)
        if last:
            if exists and ov.mode == "+":
                raise ConfigError(
                    f"{_dotted(here)} (from {_COMMAND_LINE}) - +key adds a new key but "
                    f"'{_dotted(here)}' exists; use {_dotted(here)}=... or ++{_dotted(here)}=..."
                )
            if isinstance(ov.value, dict) and isinstance(node.get(key), dict):
                _merge(node[key], ov.value, sources, _COMMAND_LINE, here)
                return
            node[key] = ov.value
        elif not exists:
            node[key] = {}
        node = node[key]
    sources.mark(ov.path, _COMMAND_LINE)


# =========================================================================================
# Entry points
# =========================================================================================
def _resolve(layers: Iterable[Callable[[dict[str, Any], _Sources], None]]) -> SparrowConfig:
    """Start from the dataclass defaults, let each layer merge into the tree, then type and check it."""
    tree = _plain(dataclasses.asdict(SparrowConfig()))
    sources = _Sources()
    for layer in layers:
        layer(tree, sources)
    return _build(SparrowConfig, tree, (), sources)


def load_config(config: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> SparrowConfig:
    """Resolve a recipe (path, shipped name, or None = the default recipe) plus overrides.

    Raises :class:`ConfigError` (one line) on any problem.
    """
    if isinstance(overrides, str):
        raise TypeError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
    path = resolve_recipe(config)
    parsed = [Override.parse(text) for text in overrides]

    def apply_overrides(tree: dict[str, Any], sources: _Sources) -> None:
        for ov in parsed:
            _apply(tree, ov, sources)

    return _resolve([lambda tree, sources: _compose(path, tree, sources), apply_overrides])


def from_dict(data: Mapping[str, Any], origin: str = "<dict>") -> SparrowConfig:
    """A config from a plain mapping (e.g. :meth:`SparrowConfig.to_dict` output) over the defaults."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"a config must be a mapping of sections, got {type(data).__name__} (from {origin})"
        )
    return _resolve([lambda tree, sources: _merge(tree, data, sources, origin)])
