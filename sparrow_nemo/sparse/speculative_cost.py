"""Cost model of speculative rollout (sparse draft, dense verify) and the choice of draft budget and k.

With a per-token acceptance probability alpha (the paper's acceptance rate, i.i.d. over positions) and k
drafts per verify, a round emits on average

    E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)        (k + 1 when alpha = 1)

tokens: the accepted prefix plus the resampled or bonus token. A round of a batch at cached length L costs
k sparse decode steps under the draft budget (:meth:`DecodeCostModel.step_cost`, lengths L+1 .. L+k) plus one
verify of T = k + 1 tokens per sequence:

- FLOPs: 2 * non-embedding params * T per sequence; attention 4 * Hq * D per (query, key) pair over every
  layer, i.e. T * L + T (T + 1) / 2 keys per layer (query i sees L + i + 1 keys);
- bytes: the weights once; every layer's K and V of the L + T tokens once (the verify reads the cache once
  for all T queries, as one dense step does);
- one step overhead.

With T = 1 this is exactly one dense decode step at length L + 1, so k = 0 ("do not speculate") costs what
dense decoding costs and its speedup is 1. The predicted speedup of (budget, k) at length L is
E * dense_step(L + 1) / round(L). Per bin of cached length :func:`pick_plan` takes the (budget, k) with the
highest prediction (budgets non-decreasing over bins, as a schedule's), from an :class:`AcceptanceTable` of
measured acceptance per (bin, budget) that the trainer refreshes every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sparrow_nemo.sparse.cost_model import DecodeCostModel
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

__all__ = [
    "AcceptanceTable",
    "SpeculativeCostModel",
    "SpeculativePlan",
    "expected_tokens_per_verify",
    "pick_plan",
]


def expected_tokens_per_verify(alpha: torch.Tensor | float, k: torch.Tensor | int) -> torch.Tensor:
    """``(1 - alpha^(k+1)) / (1 - alpha)``, ``k + 1`` at alpha = 1 (float64, broadcast over both)."""
    a = torch.as_tensor(alpha, dtype=torch.float64)
    k = torch.as_tensor(k, dtype=torch.float64)
    full = torch.ones_like(a) * (k + 1)
    safe = torch.where(a < 1.0, a, torch.zeros_like(a))
    return torch.where(a < 1.0, (1 - safe ** (k + 1)) / (1 - safe), full)


@dataclass(frozen=True)
class SpeculativeCostModel:
    """Seconds of draft steps, verify passes and dense steps of a batch, from a :class:`DecodeCostModel`.

    Every method takes ``cached_len`` [...] integer tokens and ``batch`` [...] sequences (broadcast), and
    returns float64 seconds for the whole batch.

    Attributes:
        decode: the decode cost model (model shape, hardware, dense layers, element sizes).
        page_size: tokens per KV page of the draft's sparse rule.
    """

    decode: DecodeCostModel
    page_size: int = 16

    def draft_step_s(
        self, cached_len: torch.Tensor, budget: torch.Tensor, batch: torch.Tensor
    ) -> torch.Tensor:
        """One sparse decode step at ``cached_len`` (the fed token included) under ``budget`` tokens."""
        cached, budget, batch = (torch.as_tensor(x, dtype=torch.int64) for x in (cached_len, budget, batch))
        cached, budget, batch = torch.broadcast_tensors(cached, budget, batch)
        flat = cached.reshape(-1)
        read = torch.empty_like(flat)
        scored = torch.empty_like(flat)
        for b in torch.unique(budget).tolist():  # one schedule per distinct budget (a handful)
            at = budget.reshape(-1) == b
            schedule = BudgetSchedule(bin_tokens=1, budgets=(int(b),), page_size=self.page_size)
            read[at], scored[at] = self.decode.sparse_reads(flat[at], schedule)
        cost = self.decode.step_cost(flat[:, None], read[:, None], scored[:, None], batch.reshape(-1, 1))
        return cost.total_s.reshape(cached.shape)

    def dense_step_s(self, cached_len: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        """One dense decode step at ``cached_len`` (the fed token included)."""
        return self.draft_step_s(cached_len, torch.tensor(DENSE_BUDGET), batch)

    def verify_s(self, cached_len: torch.Tensor, tokens: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        """One dense verify of ``tokens`` positions per sequence after ``cached_len`` cached tokens."""
        m, s = self.decode, self.decode.shape
        cached, tokens, batch = (torch.as_tensor(x, dtype=torch.float64) for x in (cached_len, tokens, batch))
        keys = tokens * cached + tokens * (tokens + 1) / 2  # (query, key) pairs per layer
        params = float(s.non_embedding_parameters())
        flops = batch * (2 * params * tokens + 4 * s.num_attention_heads * s.head_dim * s.num_layers * keys)
        kv_bytes = 2 * s.num_key_value_heads * s.head_dim * m.kv_bytes * s.num_layers * (cached + tokens)
        mem = params * m.weight_bytes + batch * kv_bytes
        hw = m.hardware
        return flops / hw.peak_flops + mem / hw.mem_bandwidth + hw.step_overhead_s

    def round_s(
        self, cached_len: torch.Tensor, budget: torch.Tensor, k: torch.Tensor, batch: torch.Tensor
    ) -> torch.Tensor:
        """k draft steps (lengths L+1 .. L+k) and the verify of k + 1 tokens, at ``cached_len`` = L."""
        cached, budget, k, batch = torch.broadcast_tensors(
            *(torch.as_tensor(x, dtype=torch.int64) for x in (cached_len, budget, k, batch))
        )
        total = self.verify_s(cached, k + 1, batch)
        for j in range(int(k.max()) if k.numel() else 0):
            step = self.draft_step_s(cached + j + 1, budget, batch)
            total = total + torch.where(k > j, step, torch.zeros_like(step))
        return total

    def speedup(
        self,
        alpha: torch.Tensor | float,
        cached_len: torch.Tensor,
        budget: torch.Tensor,
        k: torch.Tensor,
        batch: torch.Tensor,
    ) -> torch.Tensor:
        """Predicted tokens/s of speculation over dense decoding at cached length L: E * dense(L+1) / round(L)."""
        cached = torch.as_tensor(cached_len, dtype=torch.int64)
        dense = self.dense_step_s(cached + 1, batch)
        return expected_tokens_per_verify(alpha, k) * dense / self.round_s(cached, budget, k, batch)

    def predicted_speedup(
        self,
        plan: SpeculativePlan,
        alpha_per_bin: Sequence[float],
        lengths: Sequence[int] | torch.Tensor,
        prompt_len: Sequence[int] | torch.Tensor | int,
    ) -> float:
        """Dense over speculative decode time of a batch with these response ``lengths`` [N] and prompts.

        Response token t of a sequence sits at cached length prompt + t, in a batch of the sequences still
        generating then; under speculation it costs 1 / E of a round there, with the plan's (budget, k) and
        ``alpha_per_bin`` of its bin (the last value holds for longer contexts).
        """
        lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
        prompts = torch.as_tensor(prompt_len, dtype=torch.int64).reshape(-1).expand(lengths.shape[0])
        if lengths.numel() == 0 or int(lengths.max()) <= 0 or not alpha_per_bin:
            raise ValueError("predicted_speedup: needs responses of >= 1 token and alpha for >= 1 bin")
        t = torch.arange(int(lengths.max()))
        valid = t[None, :] < lengths[:, None]  # [N, T]
        live = valid.sum(0)[None, :].expand_as(valid)[valid]
        cached = (prompts[:, None] + t[None, :])[valid]
        bins = cached // plan.bin_tokens
        budget, k = plan.budgets_for(cached), plan.k_for(cached)
        alpha = torch.tensor(alpha_per_bin, dtype=torch.float64)[bins.clamp(max=len(alpha_per_bin) - 1)]
        dense = (self.dense_step_s(cached + 1, live) / live).sum()
        spec = (self.round_s(cached, budget, k, live) / (live * expected_tokens_per_verify(alpha, k))).sum()
        return float(dense / spec)


@dataclass(frozen=True)
class SpeculativePlan:
    """Draft budget (tokens) and k per bin of ``bin_tokens`` cached tokens (the last bin holds beyond), and the
    speedup predicted for each when it was picked."""

    bin_tokens: int
    budgets: tuple[int, ...]
    draft_tokens: tuple[int, ...]
    predicted: tuple[float, ...] = ()

    def budgets_for(self, cached_len: torch.Tensor) -> torch.Tensor:
        """[...] int64 budget per cached length."""
        return self._lookup(self.budgets, cached_len)

    def k_for(self, cached_len: torch.Tensor) -> torch.Tensor:
        """[...] int64 k per cached length."""
        return self._lookup(self.draft_tokens, cached_len)

    def _lookup(self, table: tuple[int, ...], cached_len: torch.Tensor) -> torch.Tensor:
        values = torch.tensor(table, dtype=torch.int64, device=cached_len.device)
        return values[torch.clamp(cached_len.to(torch.int64) // self.bin_tokens, max=len(table) - 1)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "bin_tokens": self.bin_tokens,
            "budgets": list(self.budgets),
            "draft_tokens": list(self.draft_tokens),
            "predicted": list(self.predicted),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativePlan:
        return cls(
            bin_tokens=int(data["bin_tokens"]),
            budgets=tuple(int(b) for b in data["budgets"]),
            draft_tokens=tuple(int(k) for k in data["draft_tokens"]),
            predicted=tuple(float(p) for p in data.get("predicted", ())),
        )


class AcceptanceTable:
    """Measured acceptance per (bin of cached length, draft budget): exponentially decayed sums.

    ``update`` adds one step's acceptance tests (each a drafted token's exact ``sum_v min(p, q)`` at its
    cached length and budget) after multiplying the old sums by ``decay``, so the estimate follows the
    policy as it trains. :meth:`estimates` gives the measured mean where there is data and otherwise an
    optimistic bound (acceptance does not fall when the budget grows and does not rise with the context):
    the smallest of 1, the same bin's nearest larger measured budget and the previous bin's estimate.
    Optimism makes :func:`pick_plan` try an untried budget once, which costs speed, never correctness.
    """

    def __init__(self, bin_tokens: int, decay: float = 0.5) -> None:
        if bin_tokens <= 0 or not 0.0 <= decay <= 1.0:
            raise ValueError(
                f"AcceptanceTable: bin_tokens must be > 0 and decay in [0, 1], got {bin_tokens}, {decay}"
            )
        self.bin_tokens = bin_tokens
        self.decay = decay
        self.sums: dict[tuple[int, int], list[float]] = {}  # (bin, budget) -> [sum of alpha, weight]

    def update(self, cached_len: torch.Tensor, budget: torch.Tensor, alpha: torch.Tensor) -> None:
        """Decay the old sums, then add the tests ``alpha [n]`` at ``cached_len [n]`` under ``budget [n]``."""
        self.add(self.cell_sums(cached_len, budget, alpha))

    def cell_sums(
        self, cached_len: torch.Tensor, budget: torch.Tensor, alpha: torch.Tensor
    ) -> dict[tuple[int, int], tuple[float, float]]:
        """(bin, budget) -> (sum of alpha, number of tests) of the tests ``alpha [n]`` (one step's, one rank's)."""
        if alpha.numel() == 0:
            return {}
        bins = cached_len.to(torch.int64) // self.bin_tokens
        keys = torch.stack([bins, budget.to(torch.int64)], dim=1)
        cells, inverse = torch.unique(keys, dim=0, return_inverse=True)
        sums = torch.zeros(len(cells), dtype=torch.float64).index_add_(0, inverse, alpha.double())
        counts = torch.bincount(inverse, minlength=len(cells)).double()
        return {
            (b, budget_tokens): (s, n)
            for (b, budget_tokens), s, n in zip(cells.tolist(), sums.tolist(), counts.tolist())
        }

    def add(self, cells: dict[tuple[int, int], tuple[float, float]]) -> None:
        """Decay the old sums, then add one step's :meth:`cell_sums` (of one rank, or summed over ranks)."""
        for cell in self.sums.values():
            cell[0] *= self.decay
            cell[1] *= self.decay
        for key, (s, n) in cells.items():
            cell = self.sums.setdefault(key, [0.0, 0.0])
            cell[0] += s
            cell[1] += n

    def measured(self, bin_index: int, budget: int, min_weight: float = 1.0) -> float | None:
        """The decayed mean acceptance of (bin, budget), or None with less than ``min_weight`` behind it."""
        cell = self.sums.get((bin_index, budget))
        return None if cell is None or cell[1] < min_weight else cell[0] / cell[1]

    def estimates(self, num_bins: int, candidates: Sequence[int]) -> list[dict[int, float]]:
        """Per bin 0 .. num_bins - 1, per candidate budget: the measured mean, else the optimistic bound of
        the class docstring."""
        ordered = sorted(set(int(c) for c in candidates))
        out: list[dict[int, float]] = []
        for i in range(num_bins):
            row: dict[int, float] = {}
            for j, budget in enumerate(ordered):
                value = self.measured(i, budget)
                if value is None:
                    larger = (self.measured(i, b) for b in ordered[j + 1 :])
                    bounds = [1.0, next((v for v in larger if v is not None), 1.0)]
                    if out:
                        bounds.append(out[-1][budget])
                    value = min(bounds)
                row[budget] = value
            out.append(row)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "bin_tokens": self.bin_tokens,
            "decay": self.decay,
            "cells": [[b, budget, s, n] for (b, budget), (s, n) in sorted(self.sums.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bin_tokens, self.decay = int(state["bin_tokens"]), float(state["decay"])
        self.sums = {(int(b), int(budget)): [float(s), float(n)] for b, budget, s, n in state["cells"]}


def pick_plan(
    cost: SpeculativeCostModel,
    table: AcceptanceTable,
    num_bins: int,
    candidates: Sequence[int],
    max_draft_tokens: int,
    batch: int,
) -> SpeculativePlan:
    """Per bin 0 .. num_bins - 1 (representative length: its middle), the (budget, k) with the highest
    predicted speedup, budgets non-decreasing over bins; k = 0 (dense decoding) when nothing beats 1.

    Ties go to the smaller k, then the smaller budget. ``candidates`` are the draft budgets (tokens).
    """
    if num_bins <= 0 or not candidates or max_draft_tokens < 0 or batch <= 0:
        raise ValueError(
            "pick_plan: needs num_bins > 0, candidate budgets, max_draft_tokens >= 0 and batch > 0"
        )
    budgets, ks, predicted = [], [], []
    floor = 0
    ordered = sorted(set(int(c) for c in candidates))
    k_grid = torch.arange(max_draft_tokens + 1)
    alphas = table.estimates(num_bins, ordered)
    for i in range(num_bins):
        length = torch.tensor(int((i + 0.5) * table.bin_tokens))
        best = (1.0, 0, max(floor, ordered[0]))  # (speedup, k, budget): dense decoding unless beaten
        for budget in (b for b in ordered if b >= floor):
            alpha = alphas[i][budget]
            gains = cost.speedup(alpha, length, torch.tensor(budget), k_grid, torch.tensor(batch))
            k = int(torch.argmax(gains))  # first maximum: the smallest k
            if float(gains[k]) > best[0] + 1e-12:
                best = (float(gains[k]), k, budget)
        speed, k, budget = best
        budgets.append(budget)
        ks.append(k)
        predicted.append(speed)
        floor = budget
    return SpeculativePlan(table.bin_tokens, tuple(budgets), tuple(ks), tuple(predicted))
