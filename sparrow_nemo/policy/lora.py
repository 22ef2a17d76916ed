"""LoRA adapters on the megatron-core policy's linear layers (DistillSparse), tensor-parallel aware.

The adapter adds ``scaling * (x @ A.T) @ B.T`` (``scaling = alpha / rank``) to a linear layer's output,
through forward hooks, and only while :meth:`MegatronLora.active` is entered: dense logprobs and the
policy update never see it. Its parameters live outside the ``GPTModel`` (the policy's optimizer,
DDP buffers and checkpoints are untouched).

Tensor parallelism (sequence parallelism off):

- column-parallel layers (``linear_qkv``, ``linear_fc1``): ``A [r, in]`` replicated, ``B`` split on
  its output rows exactly like the weight (megatron's fused layouts). ``h = x @ A.T`` goes through
  megatron's ``copy_to_tensor_model_parallel_region`` (forward identity, backward all-reduce), so
  ``A``'s gradient is the sum over all output shards and equal on every rank.
- row-parallel layers (``linear_proj``, ``linear_fc2``): ``A`` split on its input columns like the
  weight, the partial ``x_local @ A_local.T`` all-reduced (``reduce_from_tensor_model_parallel_region``)
  before the replicated ``B [out, r]``.

Import/export use :class:`~sparrow_nemo.hf_qwen3.LoraAdapter` (the rollout engines' LoRA) in Hugging Face
module names: the fused ``linear_qkv`` is ``q_proj``/``k_proj``/``v_proj`` with one shared ``A`` and ``B``
split by rows, ``linear_fc1`` likewise ``gate_proj``/``up_proj``; the row layouts reuse the weights'
(:mod:`sparrow_nemo.policy.tp_layout`), so export -> ``engine.set_lora`` reproduces the policy exactly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from sparrow_nemo.hf_qwen3 import LoraAdapter
from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.policy.fused_norm import linear_input
from sparrow_nemo.policy.model import PolicyModelSpec, unwrap_model
from sparrow_nemo.policy.parallel import stage_layer_range
from sparrow_nemo.policy.tp_layout import (
    COLUMNS,
    FC1,
    QKV,
    all_gather_shards,
    fuse_fc1,
    fuse_qkv,
    gather_stage_tensors,
    merge_shards,
    split_shard,
)

#: megatron module (under ``decoder.layers.{i}.``) -> (HF modules, column-parallel?, row layout of B / A)
TARGETS: dict[str, tuple[tuple[str, ...], bool, str]] = {
    "linear_qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), True, QKV),
    "linear_proj": (("self_attn.o_proj",), False, COLUMNS),
    "linear_fc1": (("mlp.gate_proj", "mlp.up_proj"), True, FC1),
    "linear_fc2": (("mlp.down_proj",), False, COLUMNS),
}
_PARENT = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}


@dataclass(frozen=True)
class LoraConfig:
    """Adapter hyper-parameters (recipe ``distill.lora_rank``, ``lora_alpha``, ``target_modules``: see
    :meth:`from_hf_targets`).

    Attributes:
        rank: r, the inner dimension.
        alpha: output scaling numerator (scaling = alpha / rank; paper: 16).
        targets: megatron linear names to adapt (default: all four per layer).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank <= 0:
            raise ValueError(f"LoraConfig.rank must be > 0, got {self.rank}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(
                f"LoraConfig.targets must be a non-empty subset of {list(TARGETS)}, got {unknown}"
            )

    @classmethod
    def from_hf_targets(cls, rank: int, alpha: float, modules: Sequence[str]) -> LoraConfig:
        """From HF linear names (recipe ``distill.target_modules``); fused groups must be named whole.

        ``q_proj``/``k_proj``/``v_proj`` are one megatron linear (one shared A), as are ``gate_proj``/``up_proj``.
        """
        targets = []
        for target, (hf_modules, _, _) in TARGETS.items():
            short = [m.split(".")[-1] for m in hf_modules]
            named = [m for m in short if m in modules]
            if named and len(named) != len(short):
                raise ValueError(
                    f"LoRA target_modules: {short} are fused in megatron ({target}); name all of them or none, "
                    f"got {named}"
                )
            if named:
                targets.append(target)
        unknown = sorted(set(modules) - {m.split(".")[-1] for hf, _, _ in TARGETS.values() for m in hf})
        if unknown:
            raise ValueError(f"LoRA target_modules: unknown {unknown}")
        return cls(rank=rank, alpha=alpha, targets=tuple(targets))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _in_out(shape: Qwen3Shape, target: str) -> tuple[int, int]:
    """(in_features, out_features) of one full (unsplit) megatron linear."""
    h, d, i = shape.hidden_size, shape.head_dim, shape.intermediate_size
    qkv = (shape.num_attention_heads + 2 * shape.num_key_value_heads) * d
    return {
        "linear_qkv": (h, qkv),
        "linear_proj": (shape.num_attention_heads * d, h),
        "linear_fc1": (h, 2 * i),
        "linear_fc2": (i, h),
    }[target]


def lora_shapes(
    shape: Qwen3Shape, target: str, rank: int, tp: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(A shape, B shape)`` of one adapted megatron linear on one TP rank: column-parallel layers split B's
    rows, row-parallel ones A's columns (as the weight)."""
    fan_in, fan_out = _in_out(shape, target)
    if TARGETS[target][1]:
        return (rank, fan_in), (fan_out // tp, rank)
    return (rank, fan_in // tp), (fan_out, rank)


def init_adapter(shape: Qwen3Shape, config: LoraConfig, seed: int = 0) -> LoraAdapter:
    """A fresh adapter in HF names: A ~ U(-1/sqrt(in), 1/sqrt(in)) (one per megatron linear), B = 0.

    B = 0 makes the adapted model start equal to the base model. The draw depends only on ``seed``, so
    every tensor-parallel layout imports the same adapter.
    """
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(shape.num_layers):
        for target in config.targets:
            fan_in, _ = _in_out(shape, target)
            a = (torch.rand(config.rank, fan_in, generator=gen) * 2 - 1) / math.sqrt(fan_in)
            for hf in TARGETS[target][0]:
                fan_out = _hf_out(shape, hf)
                weights[f"model.layers.{layer}.{hf}"] = (a.clone(), torch.zeros(fan_out, config.rank))
    return LoraAdapter(weights=weights, scaling=config.scaling)


def _hf_out(shape: Qwen3Shape, hf_module: str) -> int:
    d = shape.head_dim
    return {
        "self_attn.q_proj": shape.num_attention_heads * d,
        "self_attn.k_proj": shape.num_key_value_heads * d,
        "self_attn.v_proj": shape.num_key_value_heads * d,
        "self_attn.o_proj": shape.hidden_size,
        "mlp.gate_proj": shape.intermediate_size,
        "mlp.up_proj": shape.intermediate_size,
        "mlp.down_proj": shape.hidden_size,
    }[hf_module]


class MegatronLora(torch.nn.Module):
    """This rank's LoRA shards for the layers of its pipeline stage, hooked into the model.

    Parameters are named ``layers.{global layer}.{target}.a`` / ``.b`` (A: [r, in_local],
    B: [out_local, r], the model's dtype and device).

    Args:
        model: this rank's megatron ``GPTModel`` (possibly wrapped), local or Transformer Engine layer spec.
        spec: what was built on this rank.
        config: rank, alpha, targets.
        adapter: initial weights in HF names (default :func:`init_adapter` with ``seed``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        spec: PolicyModelSpec,
        config: LoraConfig,
        adapter: LoraAdapter | None = None,
        seed: int = 0,
    ) -> None:
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        inner = unwrap_model(model)
        if inner.config.sequence_parallel:
            raise ValueError("LoRA: sequence parallelism is not supported")
        self.spec = spec
        self.config = config
        self.enabled = False
        dtype = inner.config.params_dtype
        device = next(inner.parameters()).device
        self.params = torch.nn.ParameterDict()
        self._hooks = []
        layers = stage_layer_range(spec.shape.num_layers, spec.layout.pp, spec.pp_rank)
        for local, layer in enumerate(layers):
            block = inner.decoder.layers[local]
            for target in config.targets:
                column = TARGETS[target][1]
                a_shape, b_shape = lora_shapes(spec.shape, target, config.rank, spec.layout.tp)
                key = self.key(layer, target)
                a = torch.nn.Parameter(torch.zeros(a_shape, dtype=dtype, device=device))
                b = torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))
                # megatron's marker: split weights count on every TP rank in the grad norm, replicated once
                set_tensor_model_parallel_attributes(b if column else a, True, 0 if column else 1, 1)
                self.params[key + "__a"], self.params[key + "__b"] = a, b
                module = getattr(getattr(block, _PARENT[target]), target)
                self._hooks.append(module.register_forward_hook(self._hook(key, column), with_kwargs=True))
        if spec.pre_process:
            self._hooks.append(inner.embedding.register_forward_hook(self._embedding_hook))
        self.load_adapter(adapter if adapter is not None else init_adapter(spec.shape, config, seed))

    @staticmethod
    def key(layer: int, target: str) -> str:
        """Parameter-name stem of one adapted linear (``__a`` / ``__b`` appended)."""
        return f"layers__{layer}__{target}"

    # ----------------------------------------------------------------- forward
    def _hook(self, key: str, column: bool):
        def hook(module, args, kwargs, output):
            if not self.enabled:
                return output
            # under the TE spec linear_qkv / linear_fc1 normalise their input themselves (fused_norm)
            x = linear_input(module, args[0] if args else kwargs["input_"])
            out, bias = output
            return out + self._delta(x, key, column).to(out.dtype), bias

        return hook

    def _embedding_hook(self, _module, _args, output):
        """While the adapter trains, the (frozen) embedding output requires grad: megatron's activation
        recompute only back-propagates through a recomputed block whose inputs require grad, and the
        adapter's parameters are not among them."""
        if self.enabled and torch.is_grad_enabled() and not output.requires_grad:
            return output.detach().requires_grad_(True)
        return output

    def _delta(self, x: torch.Tensor, key: str, column: bool) -> torch.Tensor:
        """``scaling * (x @ A.T) @ B.T`` with the TP collectives of the module doc."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        a, b = self.params[key + "__a"], self.params[key + "__b"]
        h = torch.nn.functional.linear(x, a)
        if self.spec.layout.tp > 1:
            h = (
                copy_to_tensor_model_parallel_region(h)
                if column
                else reduce_from_tensor_model_parallel_region(h)
            )
        return self.config.scaling * torch.nn.functional.linear(h, b)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Apply the adapter to the model's forwards inside the block (off again afterwards)."""
        previous, self.enabled = self.enabled, True
        try:
            yield
        finally:
            self.enabled = previous

    def remove(self) -> None:
        """Detach the hooks from the model (the adapter can no longer be applied)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ----------------------------------------------------------------- HF import / export
    def _layers(self) -> list[int]:
        return list(stage_layer_range(self.spec.shape.num_layers, self.spec.layout.pp, self.spec.pp_rank))

    @torch.no_grad()
    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Copy an HF-named adapter (this stage's layers, this rank's shards) into the parameters.

        Modules fused in megatron must share one A (``q/k/v_proj``, ``gate/up_proj``); the scaling and rank
        must match the config. Every targeted module of this stage must be present.
        """
        if not math.isclose(adapter.scaling, self.config.scaling):
            raise ValueError(f"LoRA adapter scaling {adapter.scaling} != alpha/rank = {self.config.scaling}")
        shape, tp, rank = self.spec.shape, self.spec.layout.tp, self.spec.tp_rank
        for layer in self._layers():
            for target in self.config.targets:
                hf_modules, column, layout = TARGETS[target]
                names = [f"model.layers.{layer}.{m}" for m in hf_modules]
                missing = [n for n in names if n not in adapter.weights]
                if missing:
                    raise KeyError(f"LoRA adapter lacks {missing} (targets {list(self.config.targets)})")
                a_list = [adapter.weights[n][0] for n in names]
                b_list = [adapter.weights[n][1] for n in names]
                if any(not torch.equal(a, a_list[0]) for a in a_list[1:]):
                    raise ValueError(
                        f"LoRA adapter: {names} are fused in megatron and must share one A matrix"
                    )
                if column:
                    a = a_list[0]
                    b = (
                        fuse_qkv(*b_list, shape=shape, tp=tp, rank=rank)
                        if layout == QKV
                        else (fuse_fc1(*b_list, tp=tp, rank=rank))
                    )
                else:
                    a, b = split_shard(a_list[0], COLUMNS, tp, rank, 0), b_list[0]
                key = self.key(layer, target)
                for suffix, value in (("__a", a), ("__b", b)):
                    param = self.params[key + suffix]
                    if tuple(value.shape) != tuple(param.shape):
                        raise ValueError(
                            f"LoRA adapter for {names}: {suffix[2:].upper()} shard {tuple(value.shape)}, "
                            f"expected {tuple(param.shape)} (rank {self.config.rank})"
                        )
                    param.copy_(value)

    @torch.no_grad()
    def export_adapter(self, grads: bool = False) -> LoraAdapter:
        """The whole adapter (all layers, full matrices) in HF names on every rank (CPU). Collective.

        ``grads=True`` exports the parameters' gradients in the same layout instead (zeros where None).
        """
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()
        shape = self.spec.shape
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in self._layers():
            for target in self.config.targets:
                hf_modules, column, layout = TARGETS[target]
                key = self.key(layer, target)
                a, b = (self._value(self.params[key + s], grads) for s in ("__a", "__b"))
                split, whole = (b, a) if column else (a, b)
                merged = merge_shards(all_gather_shards(split, tp_group), layout, shape)
                replicated = whole.clone()
                for name, part in zip(hf_modules, merged, strict=True):
                    pair = (replicated, part) if column else (part, replicated)
                    out[f"model.layers.{layer}.{name}"] = tuple(t.cpu() for t in pair)
        if self.spec.layout.pp > 1:  # every stage's layers, as named tensors (the pair's halves as .a / .b)
            flat = {
                f"{name}.{half}": t for name, pair in out.items() for half, t in zip("ab", pair, strict=True)
            }
            flat = gather_stage_tensors(flat, ps.get_pipeline_model_parallel_group())
            out = {name[:-2]: (flat[name[:-2] + ".a"], t) for name, t in flat.items() if name.endswith(".b")}
        return LoraAdapter(weights=out, scaling=self.config.scaling)

    @staticmethod
    def _value(param: torch.nn.Parameter, grads: bool) -> torch.Tensor:
        if not grads:
            return param.detach()
        return param.grad.detach() if param.grad is not None else torch.zeros_like(param)


@contextlib.contextmanager
def frozen(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block no parameter of ``model`` requires grad (the adapter's step leaves the policy alone)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
