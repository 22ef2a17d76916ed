"""Optimizer, gradient synchronisation and clipping for the megatron policy.

What runs where (:func:`wrap_for_training`; the megatron branch is the default with CUDA):

- megatron branch (GPU): megatron-core's ``DistributedDataParallel`` (contiguous grad buffers, DP
  reduce-scatter/all-reduce) and ``get_megatron_optimizer`` (Adam, distributed optimizer when
  ``OptimizerSettings.distributed`` and dp > 1), stepped by :class:`MegatronPolicyOptimizer`. Gradient
  finalisation is megatron's ``finalize_model_grads``.
- torch branch (CPU): both allocate on CUDA, so :class:`TorchPolicyOptimizer` uses ``torch.optim.AdamW``
  and does by hand what megatron's ``finalize_model_grads`` + ``clip_grad_norm`` do:
  1. sum of every gradient over the data-parallel group (all-reduce);
  2. sum of the q/k RMSNorm gradients over the tensor-parallel group (one weight shared by all
     heads, while each rank holds a slice of the heads); the other replicated weights (input and
     pre-MLP norms, final norm) already receive identical full gradients on every TP rank;
  3. sum of the tied embedding / output gradients over the embedding group (first + last stage)
     when pp > 1 and the embeddings are tied;
  4. global L2 norm over the model-parallel group, counting TP-replicated and PP-shared weights once,
     then scaling every gradient by ``min(1, clip / (norm + 1e-6))``.

Gradients are *summed* over data-parallel ranks in both branches (megatron: ``calculate_per_token_loss``,
which also stops its schedule from dividing losses by the number of micro-batches): the losses arrive
weighted already (:mod:`sparrow_nemo.policy.train_step`). Weight decay skips 1-D weights and biases in
both (:func:`decays`, megatron's ``get_standard_config_overrides`` rule).

Non-finite guard (both paths): the global norm is computed after the gradient sync, so every rank sees
the same value; when it is not finite (a NaN/inf gradient on any rank) the update is skipped - no weight
and no optimizer moment changes - and :meth:`step` says so in its :class:`UpdateOutcome`. On GPU with
fp16, megatron's grad scaler reports overflows first (``"loss_scale"``; the scaler backs off by itself).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparrow_nemo.config.schema import NON_NEGATIVE, POSITIVE, Section, interval, knob
from sparrow_nemo.policy.model import unwrap_model


@dataclass(frozen=True)
class OptimizerSettings(Section):
    """Adam(W) for the policy: the recipe's ``policy.optimizer`` section.

    Default lr 1e-6: the usual RL-from-instruct rate for Qwen3 (the tiny CPU recipes set 1e-3).
    """

    lr: float = knob(1e-6, "peak learning rate (constant)", check=POSITIVE)
    betas: tuple[float, ...] = knob((0.9, 0.999), "Adam beta1, beta2", check=interval(0, 1, hi_open=True))
    eps: float = knob(1e-8, "Adam epsilon", check=POSITIVE)
    weight_decay: float = knob(
        0.01, "decoupled weight decay (not applied to 1-D weights: the norms)", check=NON_NEGATIVE
    )
    grad_clip: float = knob(1.0, "clip the global gradient L2 norm to this; 0 = off", check=NON_NEGATIVE)
    distributed: bool = knob(
        True, "megatron's distributed optimizer on GPU (optimizer state sharded over data-parallel ranks)"
    )

    def check(self) -> None:
        if len(self.betas) != 2:
            raise self.invalid("betas", "two numbers [beta1, beta2]")


@dataclass(frozen=True)
class UpdateOutcome:
    """What one optimizer step did.

    Attributes:
        grad_norm: global L2 gradient norm before clipping (NaN when megatron's fp16 scaler found an overflow).
        skipped: None when the update was applied; else why not: ``"grad_norm"`` (the global gradient norm
            is not finite) or ``"loss_scale"`` (fp16 grad-scaler overflow, GPU only).
    """

    grad_norm: float
    skipped: str | None = None


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies: not to 1-D weights (the norms) nor biases, as megatron-core's default
    param groups (``megatron/core/optimizer/__init__.py``, ``get_standard_config_overrides``: ``wd_mult=0``
    for ``len(param.shape) == 1`` or ``*.bias``)."""
    return param.dim() > 1 and not name.endswith(".bias")


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trained if decays(n, p)]
    no_decay = [p for n, p in trained if not decays(n, p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adam_state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every tensor the torch optimizers hold: their parameters (the weights, or master copies of them) and
    the per-parameter state (Adam's moments and step counts)."""
    tensors = []
    for opt in optimizers:
        tensors += [p for group in opt.param_groups for p in group["params"]]
        tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def sync_grads_cpu(model: torch.nn.Module, tie_embeddings: bool) -> None:
    """Steps 1-3 of the module docstring, in place on ``param.grad``."""
    from megatron.core import parallel_state as ps

    dp_group, dp = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if dp > 1:
            dist.all_reduce(p.grad, group=dp_group)
        if tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(p.grad, group=tp_group)
    if tie_embeddings and ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        weight = unwrap_model(model).shared_embedding_or_output_weight()
        if weight.grad is not None:
            dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def clip_grads_cpu(model: torch.nn.Module, max_norm: float) -> float:
    """Step 4 of the module docstring. Returns the global grad norm before clipping."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    counted = [
        p.grad
        for p in model.parameters()
        if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
    ]
    sq = torch.zeros((), dtype=torch.float64)
    for g in counted:
        sq += g.double().pow(2).sum()
    if ps.get_model_parallel_group() is not None and dist.get_world_size(ps.get_model_parallel_group()) > 1:
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


class TorchPolicyOptimizer:
    """CPU optimizer: ``torch.optim.AdamW`` with megatron-equivalent grad sync and clipping."""

    #: trained through the torch GPipe schedule (:mod:`sparrow_nemo.policy.pipeline`)
    megatron_schedule = False

    def __init__(self, model: torch.nn.Module, settings: OptimizerSettings, tie_embeddings: bool) -> None:
        self.model = model
        self.settings = settings
        self.tie_embeddings = tie_embeddings
        self.optimizer = torch.optim.AdamW(
            _param_groups(model, settings.weight_decay),
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
        )

    def zero_grad(self) -> None:
        """Drop accumulated gradients."""
        self.model.zero_grad(set_to_none=True)

    def step(self) -> UpdateOutcome:
        """Sync and clip the accumulated gradients, then apply them unless the global norm is not finite."""
        sync_grads_cpu(self.model, self.tie_embeddings)
        norm = clip_grads_cpu(self.model, self.settings.grad_clip)
        if not math.isfinite(norm):
            return UpdateOutcome(norm, skipped="grad_norm")
        self.optimizer.step()
        return UpdateOutcome(norm)

    def state_tensors(self) -> list[torch.Tensor]:
        """What the optimizer holds (:func:`adam_state_tensors`; the offload skips the model's own weights)."""
        return adam_state_tensors([self.optimizer])

    def grad_tensors(self) -> list[torch.Tensor]:
        """The accumulated gradients (``param.grad``)."""
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def free_grads(self) -> None:
        """Drop the gradients (the next step's backward builds them)."""
        self.zero_grad()

    def rebuild_grads(self) -> None:
        """Nothing to do: the backward allocates ``param.grad``."""

    def state_dict(self) -> dict:
        """This rank's optimizer state (its parameter shard's Adam moments)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.optimizer.load_state_dict(state)

    def has_moments(self) -> bool:
        """Whether AdamW's moments exist (it creates them at the first update)."""
        return bool(self.optimizer.state)

    def sharded_state_dict(self, model_sharded: dict, is_loading: bool) -> dict:
        """AdamW's state as megatron ``ShardedTensor`` s laid out like the parameters in ``model_sharded``
        (megatron's ``optim_state_to_sharding_state``, as its ``FP32Optimizer`` does); the step count, one for
        all parameters, as ``common_step``. Loading into an optimizer that has not updated yet first creates
        zero moments to load into."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if is_loading and not self.has_moments():
            for p in params:
                self.optimizer.state[p] = {
                    "step": torch.zeros(()),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
        state = self.optimizer.state_dict()
        steps = {float(entry["step"]) for entry in state["state"].values()}
        if len(steps) > 1:
            raise ValueError(f"AdamW step counts differ between parameters: {sorted(steps)}")
        by_id = get_param_id_to_sharded_param_map(model_sharded, params)
        optim_state_to_sharding_state(state, by_id, exclude_keys=("step",))
        state["common_step"] = steps.pop() if steps else 0.0
        return state

    def load_sharded_state_dict(self, state: dict) -> None:
        """Restore what :meth:`sharded_state_dict` described, once megatron's loader filled it in."""
        step = state.pop("common_step")
        for entry in state["state"].values():
            entry["step"] = torch.tensor(float(step))
        self.optimizer.load_state_dict(state)

    def reset_state(self) -> None:
        """The state of an optimizer that has not updated yet (what a checkpoint saved before then holds)."""
        self.optimizer.state.clear()


class MegatronPolicyOptimizer:
    """GPU optimizer: megatron DDP-wrapped model + ``get_megatron_optimizer``."""

    #: trained through megatron-core's schedule (``get_forward_backward_func``)
    megatron_schedule = True

    def __init__(self, ddp_model: torch.nn.Module, settings: OptimizerSettings, dtype: torch.dtype) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model = ddp_model
        self.distributed = settings.distributed
        config = OptimizerConfig(
            optimizer="adam",
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            adam_beta1=settings.betas[0],
            adam_beta2=settings.betas[1],
            adam_eps=settings.eps,
            clip_grad=settings.grad_clip,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=settings.distributed,
        )
        self.optimizer = get_megatron_optimizer(config, [ddp_model])
        # megatron's param groups carry ``wd_mult`` (0 for norms and biases), but only its
        # OptimizerParamScheduler.step turns that into the group's ``weight_decay``
        # (megatron/core/optimizer_param_scheduler.py); without a scheduler every group decays. Constant
        # lr and weight decay: set them once, as that step would.
        for group in self.optimizer.param_groups:
            group["weight_decay"] = settings.weight_decay * group.get("wd_mult", 1.0)

    def zero_grad(self) -> None:
        """Zero megatron's grad buffers."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> UpdateOutcome:
        """Apply the (already finalized by the schedule) gradients unless they are not finite.

        megatron's own ``step()`` checks only fp16 overflows; this is its sequence (prepare, global norm,
        clip by that norm, update) with the norm checked before anything is written, for every precision.
        """
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        optimizer = self.optimizer
        if optimizer.prepare_grads():  # fp16: unscaled, found inf/NaN, scaler updated
            return UpdateOutcome(float("nan"), skipped="loss_scale")
        grad_norm = float(optimizer.get_grad_norm())  # reduced over the grad-stats group: equal on all ranks
        if not math.isfinite(grad_norm):
            return UpdateOutcome(grad_norm, skipped="grad_norm")
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = sub.get_parameters()
            if sub.config.clip_grad > 0 and params and not getattr(sub, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(
                    params,
                    max_norm=sub.config.clip_grad,
                    total_norm=grad_norm,
                    use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        optimizer.step_with_ready_grads()
        return UpdateOutcome(grad_norm)

    def _subs(self) -> list:
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def state_tensors(self) -> list[torch.Tensor]:
        """What megatron's torch optimizers hold: parameters (fp32 master shards in bf16 training, views of the
        model's weights in fp32) and Adam's state."""
        return adam_state_tensors(sub.optimizer for sub in self._subs() if sub.optimizer is not None)

    def grad_tensors(self) -> list[torch.Tensor]:
        """megatron DDP's contiguous gradient buffers (``param.main_grad`` views them)."""
        return [b.grad_data for b in self.model.buffers + self.model.expert_parallel_buffers]

    def free_grads(self) -> None:
        """Free DDP's gradient buffers (megatron's ``offload_grad_buffers``: storage resized to 0)."""
        cuda = torch.cuda.is_available()
        self.model.offload_grad_buffers(synchronize=cuda, empty_cache=False)

    def rebuild_grads(self) -> None:
        """Reallocate DDP's gradient buffers, zeroed (``restore_grad_buffers``)."""
        self.model.restore_grad_buffers(synchronize=torch.cuda.is_available())

    def has_moments(self) -> bool:
        """Whether Adam's moments exist (torch optimizers create them at the first update)."""
        return any(sub.optimizer.state for sub in self._subs())

    def sharded_state_dict(self, model_sharded: dict, is_loading: bool) -> dict:
        """megatron's own sharded optimizer state: each data-parallel rank describes its shard of the fp32
        master weights and moments as a slice of each (unpadded) gradient bucket (``dp_reshardable``), so every
        rank writes and reads its own part, nothing is gathered, and another data-parallel size can read it
        (megatron 0.16.1's ``fully_sharded_model_space`` relies on ``flattened_range``, which it no longer
        supports; ``fully_reshardable`` gathers to DP rank 0)."""
        if is_loading and not self.has_moments():  # megatron asserts a step count to describe the state
            for sub in self._subs():
                if hasattr(sub, "_init_optimizer_states_with_dummy_values"):  # DistributedOptimizer
                    sub._init_optimizer_states_with_dummy_values()  # (moments, then overwritten by the load)
        return self.optimizer.sharded_state_dict(
            model_sharded, is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )

    def load_sharded_state_dict(self, state: dict) -> None:
        """Restore what :meth:`sharded_state_dict` described (after the model's weights), under ``no_grad``: with
        fp32 params the master weights megatron copies into are the model's own leaf parameters."""
        with torch.no_grad():
            self.optimizer.load_state_dict(state)
        # megatron's DistributedOptimizer.load_state_dict (torch-Adam fallback, no TE/apex) gives every
        # parameter's state the *same* ``step`` tensor, which torch's Adam then increments in place once per
        # parameter: each its own copy, as torch's Adam made them
        for sub in self._subs():
            for entry in sub.optimizer.state.values():
                if isinstance(entry.get("step"), torch.Tensor):
                    entry["step"] = entry["step"].clone()

    def reset_state(self) -> None:
        """The state of an optimizer that has not updated yet: no moments, fp32 master weights re-derived from
        the model's (after its weights are loaded)."""
        for sub in self._subs():
            sub.optimizer.state.clear()
        self.optimizer.reload_model_params()


def _finalize_summed_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False) -> None:
    """megatron's ``finalize_model_grads`` (DP reduction, tied-embedding and layernorm syncs) without its
    division by the step's token count: the losses arrive weighted already (``train_step``)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def wrap_for_training(
    model: torch.nn.Module,
    settings: OptimizerSettings,
    tie_embeddings: bool,
    dtype: torch.dtype = torch.float32,
    megatron: bool | None = None,
):
    """``(model_to_train, optimizer)``: megatron DDP + optimizer (megatron branch), or the model itself + AdamW.

    Args:
        megatron: the megatron branch; None = when CUDA is available (the CPU tests force it through a
            test-only shim that maps megatron's CUDA allocations to CPU).
    """
    if megatron is None:
        megatron = torch.cuda.is_available()
    if not megatron:
        return model, TorchPolicyOptimizer(model, settings, tie_embeddings)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = model.config
    # read by megatron's schedule (no in-place division of the loss by num_microbatches) and by its DDP
    # (gradient_scaling_factor 1: gradients summed over DP, not averaged)
    config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            use_distributed_optimizer=settings.distributed, grad_reduce_in_fp32=True
        ),
        model,
    )
    optimizer = MegatronPolicyOptimizer(ddp, settings, dtype)
    config.finalize_model_grads_func = _finalize_summed_grads
    config.no_sync_func = ddp.no_sync
    config.grad_scale_func = optimizer.optimizer.scale_loss
    return ddp, optimizer
