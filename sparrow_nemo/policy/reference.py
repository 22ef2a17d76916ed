"""The frozen reference policy of the KL penalty: the initial weights, swapped in for one scoring pass.

As NeMo-RL's Megatron policy worker does, no second model is built: each rank keeps a host copy of its
own shard of the weights taken at the start, and for the reference log-probs copies it into the
training model, runs the dense forward, and copies the current weights back (bit-exact). Cost: one
host copy of the shard kept, one more during the pass, and two host<->device copies of the shard per
RL step (pinned host memory when CUDA is present). The optimizer state is never touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached host copy of ``t`` (pinned when CUDA is available, for fast copies back)."""
    out = t.detach().to("cpu", copy=True)
    return out.pin_memory() if torch.cuda.is_available() else out


class ReferenceWeights:
    """A snapshot of ``model``'s parameters (this rank's shard) by name, to swap in later.

    Args:
        model: the training model (possibly DDP-wrapped); parameters added to it later (e.g. a LoRA
            adapter) are not part of the reference and stay as they are during a swap.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._weights = {name: _host_copy(p) for name, p in model.named_parameters()}

    @contextmanager
    def swapped_in(self, model: torch.nn.Module) -> Iterator[None]:
        """Inside the block ``model`` holds the reference weights; its own are restored on exit."""
        params = dict(model.named_parameters())
        missing = sorted(set(self._weights) - set(params))
        if missing:
            raise ValueError(
                f"reference weights: the model has no parameter {missing[0]!r} (of {len(missing)} missing); "
                "was it rebuilt after the reference was taken?"
            )
        current = {}
        with torch.no_grad():
            for name, ref in self._weights.items():
                current[name] = params[name].detach().to("cpu", copy=True)
                params[name].copy_(ref, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, own in current.items():
                    params[name].copy_(own, non_blocking=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
