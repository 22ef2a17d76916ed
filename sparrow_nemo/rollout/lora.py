"""LoRA adapters for the rollout engine (DistillSparse: the adapter lives only in the sparse engine).

An adapter maps HF module names (``model.layers.{i}.self_attn.q_proj``, ``...mlp.down_proj``) to a pair
``(A [r, in_features], B [out_features, r])`` and one ``scaling`` (= alpha / r). The engine adds
``scaling * (x @ A.T) @ B.T`` to those linears' outputs and leaves the base weights untouched, so
removing the adapter restores the base outputs bit-exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraAdapter:
    """LoRA weights by HF module name, plus the output scaling (alpha / rank)."""

    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float

    @classmethod
    def from_alpha(
        cls, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], alpha: float
    ) -> LoraAdapter:
        """Adapter with ``scaling = alpha / r`` (r read from the first A matrix; all ranks must agree)."""
        ranks = {a.shape[0] for a, _ in weights.values()}
        if len(ranks) != 1:
            raise ValueError(
                f"LoRA adapter: all A matrices must share one rank to use alpha, got ranks {ranks}"
            )
        return cls(weights=dict(weights), scaling=alpha / ranks.pop())

    def validate(self, in_out: Mapping[str, tuple[int, int]]) -> None:
        """Check names and shapes against ``in_out``: module name -> (in_features, out_features)."""
        for name, pair in self.weights.items():
            if name not in in_out:
                allowed = ", ".join(sorted({n.split(".")[-1] for n in in_out}))
                raise KeyError(
                    f"LoRA adapter: '{name}' is not a decoder linear (allowed per layer: {allowed})"
                )
            if len(pair) != 2:
                raise ValueError(f"LoRA adapter: '{name}' must map to (A, B), got {len(pair)} tensors")
            a, b = pair
            fan_in, fan_out = in_out[name]
            if (
                a.dim() != 2
                or b.dim() != 2
                or a.shape[1] != fan_in
                or b.shape[0] != fan_out
                or a.shape[0] != b.shape[1]
            ):
                raise ValueError(
                    f"LoRA adapter: '{name}' has A {tuple(a.shape)} and B {tuple(b.shape)}, expected "
                    f"A [r, {fan_in}] and B [{fan_out}, r]"
                )

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> LoraAdapter:
        """A copy with every matrix moved/cast."""
        moved = {
            n: (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
            for n, (a, b) in self.weights.items()
        }
        return LoraAdapter(weights=moved, scaling=self.scaling)
