"""The speculative planner (``rollout.mode=speculative``, ``control.speculative``): the draft's budget and k per
bin of cached length for the next rollouts, and the ``spec/*`` metrics of a step's drafts.

:class:`SpeculativePlanner` starts from the run's schedule and ``control.speculative.draft_tokens`` in every bin;
with ``control.speculative.adapt`` it re-plans after every step from the acceptance the step measured
(:func:`~sparrow_nemo.sparse.speculative_cost.pick_plan` over an
:class:`~sparrow_nemo.sparse.speculative_cost.AcceptanceTable` per bin of ``sparsity.bin_tokens`` and draft
budget among ``control.calibration.candidate_budgets``). :func:`speculative_metrics` turns a step's draft logs
into the ``spec/*`` metrics. Executing the plan is the rollout layer's
(:class:`~sparrow_nemo.rollout.rollout_mode.RolloutModeEngine`, the torch engine's speculative rounds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sparrow_nemo.config.schema import NON_NEGATIVE, UNIT, Section, knob
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.torch.spec_decode import DraftLog
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig
from sparrow_nemo.sparse.cost_model import DecodeCostModel
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule
from sparrow_nemo.sparse.speculative_cost import (
    AcceptanceTable,
    SpeculativeCostModel,
    SpeculativePlan,
    expected_tokens_per_verify,
    pick_plan,
)


@dataclass(frozen=True)
class SpeculativePlannerConfig(Section):
    """``control.speculative``: the draft plan of a speculative rollout (``rollout.mode=speculative``: sparse
    drafts, dense verify), read by :func:`speculative_planner`."""

    draft_tokens: int = knob(
        4,
        "k, draft tokens per dense verify in every bin until the first re-plan (0 = plain dense decoding)",
        check=NON_NEGATIVE,
    )
    max_draft_tokens: int = knob(8, "the largest k the planner may pick", check=NON_NEGATIVE)
    adapt: bool = knob(
        True,
        "after every step, re-plan the draft budget (among control.calibration.candidate_budgets) and k per bin "
        "from the acceptance measured so far, for the most predicted tokens/s (rollout.cost_hardware's cost model)",
    )
    decay: float = knob(
        0.5,
        "weight of the earlier steps' acceptance in the planner's per-bin table (0 = the last step only)",
        check=UNIT,
    )

    def check(self) -> None:
        if self.draft_tokens > self.max_draft_tokens:
            raise self.invalid("draft_tokens", f"<= max_draft_tokens ({self.max_draft_tokens})")


class SpeculativePlanner:
    """The draft's (budget, k) per bin for the next rollouts, adapted from the measured acceptance.

    Args:
        cost: the cost model the plan maximises (predicted tokens/s over dense decoding).
        bin_tokens, page_size: the run's bins of cached length and KV pages.
        candidates: draft budgets (tokens) the planner may choose.
        draft_tokens: k in every bin until the first re-plan; max_draft_tokens: the largest k it may pick.
        adapt: re-plan after every step; decay: weight of the older steps' acceptance in the table.
        batch: sequences per rollout batch (the cost model's batch).
    """

    def __init__(
        self,
        cost: SpeculativeCostModel,
        bin_tokens: int,
        page_size: int,
        candidates: Sequence[int],
        draft_tokens: int,
        max_draft_tokens: int,
        adapt: bool,
        decay: float,
        batch: int,
    ) -> None:
        usable = sorted({int(b) for b in candidates if b != DENSE_BUDGET and b % page_size == 0})
        if not usable:
            raise ValueError(
                f"speculative planner: no candidate draft budget is a multiple of page_size={page_size}"
            )
        if not 0 <= draft_tokens <= max_draft_tokens:
            raise ValueError(
                f"control.speculative: draft_tokens={draft_tokens} must lie in [0, max_draft_tokens={max_draft_tokens}]"
            )
        self.cost = cost
        self.page_size = page_size
        self.candidates = usable
        self.draft_tokens = draft_tokens
        self.max_draft_tokens = max_draft_tokens
        self.adapt = adapt
        self.batch = batch
        self.table = AcceptanceTable(bin_tokens, decay)
        self.plan: SpeculativePlan | None = None  # None until the first re-plan: the run's schedule, fixed k

    def config_for(self, schedule: BudgetSchedule) -> SpeculativeConfig:
        """What ``generate`` gets when called with ``schedule`` (the run's current sparse schedule)."""
        if self.plan is None:
            ks = (self.draft_tokens,) * len(schedule.budgets)
            return SpeculativeConfig(draft_tokens=ks, draft_schedule=schedule)
        draft = BudgetSchedule(
            self.plan.bin_tokens, self.plan.budgets, self.page_size, name="speculative-plan"
        )
        return SpeculativeConfig(draft_tokens=self.plan.draft_tokens, draft_schedule=draft)

    def observe(
        self,
        samples: Sequence[RolloutSample],
        schedule: BudgetSchedule,
        gather: Callable[[Any], list[Any]] | None = None,
    ) -> dict[str, float]:
        """The step's ``spec/*`` metrics of ``samples`` under the plan it used; then the table update and (with
        adapt) a re-plan.

        ``gather``: with several ranks, an all-gather of a small object (collective): every rank's acceptance
        sums per (bin, budget) go into every rank's table, so all planners hold one table and pick one plan
        (the one a single rank would pick from all the step's samples); the metrics stay this rank's.
        """
        config = self.config_for(schedule)
        used = _plan_of(config, self.table.bin_tokens)
        logs = [s.draft for s in samples if getattr(s, "draft", None) is not None]
        metrics: dict[str, float] = {}
        cells: dict[tuple[int, int], tuple[float, float]] = {}
        seen = -1  # the largest bin of cached length a round started in
        if logs:
            metrics = speculative_metrics(samples, logs, config, self.table.bin_tokens)
            lengths = [s.response_ids.numel() for s in samples]
            prompts = [s.prompt_ids.numel() for s in samples]
            alpha = _alpha_per_bin(logs, self.table.bin_tokens, len(used.budgets))
            metrics["spec/predicted_speedup"] = self.cost.predicted_speedup(used, alpha, lengths, prompts)
            cells = self.table.cell_sums(
                *(torch.cat([getattr(d, f) for d in logs]) for f in ("cached_len", "budget", "alpha"))
            )
            rounds = [int(d.round_len.max()) for d in logs if d.round_len.numel()]
            seen = max(rounds) // self.table.bin_tokens if rounds else -1
        if gather is not None:
            parts = gather((cells, seen))
            cells = {}
            for part, _ in parts:  # rank order: every rank sums alike
                for key, (s, n) in part.items():
                    total = cells.get(key, (0.0, 0.0))
                    cells[key] = (total[0] + s, total[1] + n)
            seen = max(s for _, s in parts)
        if not cells and seen < 0:  # no draft anywhere (e.g. only dense schedules)
            return metrics
        self.table.add(cells)
        if self.adapt and seen >= 0:
            bins = max(seen + 1, len(used.budgets))
            self.plan = pick_plan(
                self.cost, self.table, bins, self.candidates, self.max_draft_tokens, self.batch
            )
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Plain data for the run checkpoint (the table and the current plan)."""
        return {"table": self.table.state_dict(), "plan": None if self.plan is None else self.plan.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.table.load_state_dict(state["table"])
        self.plan = None if state["plan"] is None else SpeculativePlan.from_dict(state["plan"])


def _plan_of(config: SpeculativeConfig, bin_tokens: int) -> SpeculativePlan:
    """The (budget, k) per bin a config used, on ``bin_tokens`` bins (its schedule's bins must be those)."""
    draft = config.draft_schedule
    if draft is None or draft.bin_tokens != bin_tokens:
        raise ValueError(
            f"speculative planner: the draft schedule must use the run's {bin_tokens}-token bins"
        )
    n = max(len(draft.budgets), len(config.draft_tokens))
    budgets = tuple(draft.budget(i * bin_tokens) for i in range(n))
    ks = tuple(config.draft_tokens[min(i, len(config.draft_tokens) - 1)] for i in range(n))
    return SpeculativePlan(bin_tokens, budgets, ks)


def _alpha_per_bin(logs: Sequence[DraftLog], bin_tokens: int, num_bins: int) -> list[float]:
    """Mean exact acceptance per bin 0 .. max(num_bins, bins seen) - 1; bins without tests take the previous
    bin's value (1.0 before any)."""
    cached = torch.cat([d.cached_len for d in logs])
    alpha = torch.cat([d.alpha for d in logs]).double()
    bins = cached // bin_tokens
    size = max(num_bins, int(bins.max()) + 1 if bins.numel() else 0)
    counts = torch.bincount(bins, minlength=size).double()
    sums = torch.bincount(bins, weights=alpha, minlength=size)
    out, last = [], 1.0
    for c, s in zip(counts.tolist(), sums.tolist()):
        last = s / c if c else last
        out.append(last)
    return out


def speculative_metrics(
    samples: Sequence[RolloutSample], logs: Sequence[DraftLog], config: SpeculativeConfig, bin_tokens: int
) -> dict[str, float]:
    """The ``spec/*`` metrics of one step's draft logs (``logs``: the samples' :class:`DraftLog` s).

    Totals: ``draft_tokens`` and ``verify_steps`` (verify passes, summed over sequences), ``accept_rate``
    (accepted / tested drafts: the empirical acceptance probability), ``accepted_fraction`` (accepted /
    drafted), ``accepted_per_verify``, ``tokens_per_verify`` (response tokens after the first, which the
    prefill gives, per verify), ``alpha`` (mean exact sum_v min(p, q) of the tested drafts) and
    ``predicted_tokens_per_verify`` (E(alpha, k) of each round from its bin's measured alpha; compare with
    ``tokens_per_verify``). Per bin ``b`` of cached length: ``accept_rate``, ``alpha`` and ``tests`` by the
    drafted token's length; ``draft_tokens``, ``verify_steps`` and ``tokens_per_verify`` by the round's start;
    ``budget`` and ``k``, the plan used.
    """
    cat = {f: torch.cat([getattr(d, f) for d in logs]) for f in DraftLog.__dataclass_fields__}
    tests, accepted = cat["accepted"].numel(), int(cat["accepted"].sum())
    drafted, verifies = int(cat["round_k"].sum()), cat["round_k"].numel()
    emitted = sum(int(s.response_ids.numel()) - 1 for s in samples if getattr(s, "draft", None) is not None)
    m: dict[str, float] = {
        "spec/draft_tokens": float(drafted),
        "spec/verify_steps": float(verifies),
        "spec/accept_rate": accepted / tests if tests else float("nan"),
        "spec/accepted_fraction": accepted / drafted if drafted else float("nan"),
        "spec/accepted_per_verify": accepted / verifies if verifies else float("nan"),
        "spec/tokens_per_verify": emitted / verifies if verifies else float("nan"),
        "spec/alpha": float(cat["alpha"].double().mean()) if tests else float("nan"),
    }
    plan = _plan_of(config, bin_tokens)
    test_bins = cat["cached_len"] // bin_tokens
    round_bins = cat["round_len"] // bin_tokens
    size = max(int(test_bins.max()) + 1 if tests else 0, int(round_bins.max()) + 1 if verifies else 0)
    n_tests = torch.bincount(test_bins, minlength=size)
    n_acc = torch.bincount(test_bins, weights=cat["accepted"].double(), minlength=size)
    sum_alpha = torch.bincount(test_bins, weights=cat["alpha"].double(), minlength=size)
    n_rounds = torch.bincount(round_bins, minlength=size)
    n_draft = torch.bincount(round_bins, weights=cat["round_k"].double(), minlength=size)
    n_emit = torch.bincount(round_bins, weights=cat["round_emitted"].double(), minlength=size)
    alpha_bins = _alpha_per_bin(logs, bin_tokens, size)
    predicted = expected_tokens_per_verify(
        torch.tensor(alpha_bins, dtype=torch.float64)[round_bins.clamp(max=len(alpha_bins) - 1)],
        cat["round_k"],
    )
    m["spec/predicted_tokens_per_verify"] = float(predicted.mean()) if verifies else float("nan")
    for b in range(size):
        if n_tests[b]:
            m[f"spec/accept_rate/bin_{b}"] = float(n_acc[b] / n_tests[b])
            m[f"spec/alpha/bin_{b}"] = float(sum_alpha[b] / n_tests[b])
            m[f"spec/tests/bin_{b}"] = float(n_tests[b])
        if n_rounds[b]:
            m[f"spec/draft_tokens/bin_{b}"] = float(n_draft[b])
            m[f"spec/verify_steps/bin_{b}"] = float(n_rounds[b])
            m[f"spec/tokens_per_verify/bin_{b}"] = float(n_emit[b] / n_rounds[b])
            m[f"spec/budget/bin_{b}"] = float(plan.budgets[min(b, len(plan.budgets) - 1)])
            m[f"spec/k/bin_{b}"] = float(plan.draft_tokens[min(b, len(plan.draft_tokens) - 1)])
    return m


def speculative_planner(
    config: SpeculativePlannerConfig,
    decode: DecodeCostModel,
    bin_tokens: int,
    page_size: int,
    candidates: Sequence[int],
    batch: int,
) -> SpeculativePlanner:
    """The planner of ``control.speculative`` on the decode cost model ``decode``
    (:func:`sparrow_nemo.rollout.tools.cost_fit.rollout_cost_model`), the run's bins (``bin_tokens``) and pages
    (``page_size``), draft budgets among ``candidates`` (tokens), ``batch`` sequences per rollout batch."""
    return SpeculativePlanner(
        SpeculativeCostModel(decode, page_size),
        bin_tokens=bin_tokens,
        page_size=page_size,
        candidates=candidates,
        draft_tokens=config.draft_tokens,
        max_draft_tokens=config.max_draft_tokens,
        adapt=config.adapt,
        decay=config.decay,
        batch=batch,
    )
