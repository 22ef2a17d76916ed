"""What the torch engine's compact decode loop records per step, regrouped per sample at the end."""

from __future__ import annotations

import torch


class StepRecorder:
    """Per-step outputs of the live rows, regrouped per sample at the end."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.steps: list[tuple[torch.Tensor, ...]] = []

    def add(self, sample_idx: torch.Tensor, *fields: torch.Tensor) -> None:
        """One decode step: ``sample_idx [b]`` and per-row fields (tokens, lp, top ids, top lp, len, budget)."""
        self.steps.append((sample_idx, *fields))

    def per_sample(self) -> list[dict[str, torch.Tensor]]:
        """Fields of each sample in step order, on CPU."""
        cols = [torch.cat(c).cpu() for c in zip(*self.steps)]
        idx = cols[0]
        order = torch.sort(idx, stable=True).indices
        counts = torch.bincount(idx, minlength=self.batch).tolist()
        names = ("response_ids", "logprobs", "top_ids", "top_logprobs", "cached_len", "kv_budget")
        split = [c[order].split(counts) for c in cols[1:]]
        return [{name: split[j][s] for j, name in enumerate(names)} for s in range(self.batch)]
