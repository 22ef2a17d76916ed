"""The policy's activation-memory settings: one object read by the model builder and by ``sparrow plan``.

:class:`MemorySettings` holds what trades compute for memory on the training path (activation
recompute, sequence parallelism, the logprob chunk, the micro-batch token budget). ``build_model``
turns it into megatron ``TransformerConfig`` fields (:meth:`MemorySettings.transformer_config_kwargs`)
and :mod:`sparrow_nemo.policy.plan` prices the same object, so the plan describes the model that runs.
Both build it with :meth:`MemorySettings.from_policy_config` from the recipe's ``policy`` section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sparrow_nemo.config.schema import AT_LEAST_ONE, Section, knob
from sparrow_nemo.policy.parallel import LayoutError, ParallelLayout

#: megatron modules recomputed by ``recompute_granularity: selective``: the MLP (its fc1 output and
#: SwiGLU products are the largest per-token activations). ``core_attn`` is left out: with flash
#: attention (Transformer Engine on GPU, torch SDPA on CPU) the core attention keeps no S x S tensor.
SELECTIVE_MODULES = ("mlp",)


@dataclass(frozen=True)
class MemorySettings(Section):
    """What decides the activation memory of a training step: the recipe's ``policy.*`` keys of these names
    (:class:`sparrow_nemo.policy.policy.PolicyConfig` extends this class, so each is declared once)."""

    recompute_granularity: Literal["none", "full", "selective"] = knob(
        "none",
        "megatron activation recomputation: full (each layer's input kept, the layer recomputed in backward), "
        "selective (the MLP recomputed), or none",
    )
    recompute_method: Literal["uniform", "block"] = knob(
        "uniform",
        "full recompute: uniform (every layer, in groups of recompute_num_layers) or block (only the first "
        "recompute_num_layers layers of each pipeline stage)",
    )
    recompute_num_layers: int = knob(
        1,
        "full recompute: layers per recomputed group (uniform) or recomputed layers per stage (block)",
        check=AT_LEAST_ONE,
    )
    sequence_parallel: bool = knob(
        False, "Megatron sequence parallelism (norm/residual activations split over TP; needs tp > 1)"
    )
    logprob_chunk_tokens: int = knob(
        4096,
        "positions per chunk of the fused output layer + logprobs/entropy/top-k: the [chunk, vocab / tp] fp32 "
        "logits are the largest transient of a step (sparrow_nemo.policy.logprobs)",
        check=AT_LEAST_ONE,
    )
    max_tokens_per_micro_batch: int | None = knob(
        None,
        "token budget per micro-batch instead of a row count: rows sorted by length, each micro-batch rows x "
        "its longest row <= this (sparrow_nemo.policy.packing); null = micro_batch_size rows",
        check=AT_LEAST_ONE,
    )

    def check(self) -> None:
        if self.recompute_granularity not in ("none", "full", "selective"):
            raise self.invalid("recompute_granularity", "none, full or selective")
        if self.recompute_method not in ("uniform", "block"):
            raise self.invalid("recompute_method", "uniform or block")

    @classmethod
    def from_policy_config(cls, policy: Any) -> MemorySettings:
        """Just these settings, from the recipe's ``policy`` section (:class:`~sparrow_nemo.policy.policy.PolicyConfig`)."""
        return cls(
            recompute_granularity=policy.recompute_granularity,
            recompute_method=policy.recompute_method,
            recompute_num_layers=policy.recompute_num_layers,
            sequence_parallel=policy.sequence_parallel,
            logprob_chunk_tokens=policy.logprob_chunk_tokens,
            max_tokens_per_micro_batch=policy.max_tokens_per_micro_batch,
        )

    def validate(self, num_layers: int, layout: ParallelLayout) -> None:
        """Raise :class:`LayoutError` for settings this model and layout cannot run."""
        if self.sequence_parallel and layout.tp == 1:
            raise LayoutError("sequence_parallel needs tensor_model_parallel_size > 1")
        if self.recompute_granularity != "full":
            return
        per_stage = num_layers // layout.pp
        if self.recompute_num_layers > per_stage:
            raise LayoutError(
                f"recompute_num_layers={self.recompute_num_layers} exceeds the {per_stage} layers of a "
                "pipeline stage"
            )
        if self.recompute_method == "uniform" and per_stage % self.recompute_num_layers:
            raise LayoutError(
                f"recompute_num_layers={self.recompute_num_layers} does not divide the {per_stage} layers "
                "of a pipeline stage (recompute_method=uniform recomputes groups of that many layers)"
            )

    def recomputed_layers(self, stage_layers: int) -> int:
        """Layers of a stage whose activations full recompute drops (0 unless ``full``)."""
        if self.recompute_granularity != "full":
            return 0
        return stage_layers if self.recompute_method == "uniform" else self.recompute_num_layers

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """The megatron ``TransformerConfig`` fields these settings set."""
        kwargs: dict[str, Any] = {"sequence_parallel": self.sequence_parallel}
        if self.recompute_granularity == "full":
            kwargs.update(
                recompute_granularity="full",
                recompute_method=self.recompute_method,
                recompute_num_layers=self.recompute_num_layers,
            )
        elif self.recompute_granularity == "selective":
            kwargs.update(recompute_granularity="selective", recompute_modules=list(SELECTIVE_MODULES))
        return kwargs


#: no recompute, no sequence parallelism, the default chunk: what a model built without settings uses
DEFAULT_MEMORY = MemorySettings()
