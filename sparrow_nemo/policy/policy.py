"""``MegatronPolicy``: the policy worker's whole API in one object (what GRPO and the CLI call).

It owns this rank's model shard and optimizer; every method is collective over the ranks of the
run (call it on all of them with the same arguments, except ``batches``, which are per DP rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from sparrow_nemo.config.schema import AT_LEAST_ONE, knob
from sparrow_nemo.hf_qwen3 import LoraAdapter, resolve_dtype
from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.checkpoint import load_policy_checkpoint, save_policy_checkpoint
from sparrow_nemo.policy.hf_import import export_hf_state_dict, load_hf_into_model
from sparrow_nemo.policy.logprobs import TOP_K, LogprobOutput
from sparrow_nemo.policy.lora import LoraConfig, MegatronLora, frozen
from sparrow_nemo.policy.memory import DEFAULT_MEMORY, MemorySettings
from sparrow_nemo.policy.model import build_model
from sparrow_nemo.policy.offload import TrainingStateOffload, device_bytes
from sparrow_nemo.policy.optim import OptimizerSettings, TorchPolicyOptimizer, wrap_for_training
from sparrow_nemo.policy.parallel import ParallelLayout, destroy_parallel, initialize_parallel
from sparrow_nemo.policy.pipeline import LossFn, compute_logprobs
from sparrow_nemo.policy.reference import ReferenceWeights
from sparrow_nemo.policy.refit import stream_weights
from sparrow_nemo.policy.sparse_forward import (
    SparsePlan,
    compute_sparse_logprobs,
    sparse_forward,
)
from sparrow_nemo.policy.train_step import Reduction, StepResult, train_step
from sparrow_nemo.sparse.pattern import SparsePattern


class MegatronPolicy:
    """A Qwen3 policy under megatron-core with TP/PP/DP.

    Args:
        shape: the model.
        layout: tp/pp/dp; must match the running world size (validated with a clear error).
        settings: optimizer settings.
        dtype: ``"float32"`` (CPU tests) or ``"bfloat16"`` (GPU).
        hf_dir: optional Hugging Face Qwen3 checkpoint directory to start from.
        use_te: Transformer Engine layer spec (``None``: when a GPU and TE are present).
        fp8: FP8 recipe name for TE (``None``: off).
        seed: model-parallel RNG seed (used for the random init when there is no ``hf_dir``).
        memory: activation recompute, sequence parallelism and the logprob chunk (the recipe's).
        megatron_training: train and score through megatron-core's DDP, optimizer and pipeline schedule
            (``None``: when CUDA is available; else the torch equivalents of :mod:`sparrow_nemo.policy.optim`).
    """

    def __init__(
        self,
        shape: Qwen3Shape,
        layout: ParallelLayout,
        settings: OptimizerSettings,
        dtype: str | torch.dtype = "float32",
        hf_dir: str | Path | None = None,
        use_te: bool | None = None,
        fp8: str | None = None,
        seed: int = 1234,
        memory: MemorySettings = DEFAULT_MEMORY,
        megatron_training: bool | None = None,
    ) -> None:
        initialize_parallel(layout, shape, seed=seed)
        model, self.spec = build_model(shape, layout, dtype, use_te=use_te, fp8=fp8, memory=memory)
        if hf_dir is not None:
            load_hf_into_model(model, self.spec, hf_dir)
        self.model, self.optimizer = wrap_for_training(
            model, settings, shape.tie_word_embeddings, resolve_dtype(dtype), megatron_training
        )
        self.lora: MegatronLora | None = None
        self.reference: ReferenceWeights | None = None
        self._offload = TrainingStateOffload(self.optimizer, self.model)

    def offload_training_state(self) -> int:
        """Free the gradient buffers and move the optimizer state to host until the next :meth:`train_step`,
        :meth:`save` or :meth:`load` (:mod:`sparrow_nemo.policy.offload`); the weights stay. Returns the
        device bytes released (0 when already offloaded)."""
        return self._offload.offload()

    def device_bytes(self) -> dict[str, int]:
        """Bytes of ``weights``, ``gradients`` and ``optimizer`` state on this rank's device."""
        return device_bytes(self.optimizer, self.model)

    def logprobs(self, batches: list[PolicyBatch], top_k: int = TOP_K) -> list[LogprobOutput]:
        """Dense log-probs, entropy and top-k per micro-batch (CPU tensors [B, S-1], on every rank)."""
        return compute_logprobs(self.model, self.spec, batches, top_k, self.optimizer.megatron_schedule)

    def keep_reference(self) -> None:
        """Take the current weights as the frozen reference policy (the KL penalty's; see
        :mod:`sparrow_nemo.policy.reference`). Call before any training step."""
        self.reference = ReferenceWeights(self.model)

    def reference_logprobs(self, batches: list[PolicyBatch], top_k: int = TOP_K) -> list[LogprobOutput]:
        """:meth:`logprobs` of the reference weights; the policy's own weights are back afterwards."""
        if self.reference is None:
            raise RuntimeError("no reference policy: call MegatronPolicy.keep_reference() first")
        with self.reference.swapped_in(self.model):
            return self.logprobs(batches, top_k)

    def enable_lora(
        self, config: LoraConfig, adapter: LoraAdapter | None = None, seed: int = 0
    ) -> MegatronLora:
        """Attach a DistillSparse LoRA adapter (HF-named ``adapter``, else a fresh one with B = 0).

        The adapter is applied only inside :meth:`sparse_logprobs` (``use_lora=True``) and the adapter's own
        training; :meth:`logprobs` and :meth:`train_step` stay dense and adapter-free.
        """
        if self.lora is not None:
            self.lora.remove()
        self.lora = MegatronLora(self.model, self.spec, config, adapter, seed)
        return self.lora

    def sparse_logprobs(
        self,
        batches: list[PolicyBatch],
        plans: list[SparsePlan],
        pattern: SparsePattern,
        use_lora: bool = True,
        top_k: int = TOP_K,
    ) -> list[LogprobOutput]:
        """Log-probs under decode-time sparse attention (what the sparse rollout engine computed).

        One :class:`SparsePlan` per micro-batch; with ``use_lora`` the attached adapter is applied.
        """
        lora = self.lora if use_lora else None
        return compute_sparse_logprobs(self.model, self.spec, batches, plans, pattern, lora, top_k)

    def lora_optimizer(self, settings: OptimizerSettings) -> TorchPolicyOptimizer:
        """AdamW over the attached adapter's parameters, with the policy's DP grad mean and TP-aware clipping."""
        return TorchPolicyOptimizer(self._require_lora(), settings, tie_embeddings=False)

    def lora_train_step(
        self,
        batches: list[PolicyBatch],
        plans: list[SparsePlan],
        pattern: SparsePattern,
        loss_fn: LossFn,
        optimizer: TorchPolicyOptimizer,
    ) -> StepResult:
        """One adapter step: ``loss_fn`` on the sparse-forward-with-LoRA outputs; the policy weights stay frozen."""
        lora = self._require_lora()
        with frozen(self.model), lora.active(), sparse_forward(self.model, plans, pattern):
            return train_step(self.model, optimizer, self.spec, batches, loss_fn)

    def _require_lora(self) -> MegatronLora:
        if self.lora is None:
            raise RuntimeError("no LoRA adapter attached: call MegatronPolicy.enable_lora(...) first")
        return self.lora

    def train_step(
        self, batches: list[PolicyBatch], loss_fn: LossFn, reduction: Reduction = "mean"
    ) -> StepResult:
        """One optimizer step on this DP rank's micro-batches: the step's loss is the mean (``reduction="mean"``)
        of ``loss_fn`` over the micro-batches of all DP ranks, or their sum (``"sum"``: ``loss_fn`` values are
        shares of a step-normalised loss, :mod:`sparrow_nemo.grpo.update`)."""
        self._offload.restore()
        return train_step(self.model, self.optimizer, self.spec, batches, loss_fn, reduction)

    def export_hf(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights on every rank (for the rollout engine's weight refit)."""
        return export_hf_state_dict(self.model, self.spec)

    def refit(self, engine: Any) -> int:
        """Stream this policy's weights into this rank's rollout ``engine`` (None on a rank without one), a piece
        at a time on the device (:mod:`sparrow_nemo.policy.refit`); returns the number of tensors sent.
        Collective over the tensor- and pipeline-parallel groups."""
        return stream_weights(self, engine)

    def save(self, root: str | Path, step: int, write_extra: Callable[[Path], None] | None = None) -> Path:
        """Atomic model + optimizer + RNG checkpoint ``<root>/step_<step>``.

        ``write_extra(staging_dir)`` runs on rank 0 before the manifest: files it writes there are part
        of the same atomic checkpoint.
        """
        self._offload.restore()
        return save_policy_checkpoint(root, step, self.model, self.optimizer, self.spec, write_extra)

    def load(self, path: str | Path) -> int:
        """Resume from a complete checkpoint directory; returns its step."""
        self._offload.restore()
        return load_policy_checkpoint(path, self.model, self.optimizer, self.spec)

    def close(self) -> None:
        """Tear down megatron's parallel state and the process group."""
        destroy_parallel()


# ----- the recipe's ``policy`` section -------------------------------------------------------------
@dataclass(frozen=True)
class PolicyConfig(MemorySettings):
    """The trained policy: megatron-core parallel layout, batching, precision, optimizer, and the activation
    memory settings (:class:`~sparrow_nemo.policy.memory.MemorySettings`, whose keys come first)."""

    renamed_keys: ClassVar[dict[str, str]] = {
        "activation_recompute": "it was replaced by policy.recompute_granularity (true = full)"
    }

    tensor_model_parallel_size: int = knob(
        1, "tensor-parallel ranks (must divide the query and KV head counts)", check=AT_LEAST_ONE
    )
    pipeline_model_parallel_size: int = knob(
        1, "pipeline stages (must divide the layer count)", check=AT_LEAST_ONE
    )
    data_parallel_size: int | None = knob(
        None, "data-parallel ranks; null = world size / (tensor x pipeline)", check=AT_LEAST_ONE
    )
    micro_batch_size: int = knob(
        4,
        "sequences per forward/backward micro-batch (rows are cut to its longest sequence)",
        check=AT_LEAST_ONE,
    )
    precision: Literal["fp32", "bf16", "fp16"] = knob(
        "fp32", "training compute precision (bf16/fp16 keep fp32 master weights)"
    )
    optimizer: OptimizerSettings = knob(doc="Adam(W) settings", factory=OptimizerSettings)
    offload_during_rollout: bool = knob(
        False,
        "during rollout, free the gradient buffers and keep the optimizer state (Adam moments, fp32 master "
        "weights) in pinned host memory, back before the update; the weights stay for the refit",
    )

    def check(self) -> None:
        super().check()
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise self.invalid("sequence_parallel", "false unless tensor_model_parallel_size > 1")
