"""The speculative cost model and the per-bin choice of draft budget and k (sparse/speculative_cost.py)."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.sparse.cost_model import DecodeCostModel
from sparrow_nemo.sparse.schedule import BudgetSchedule
from sparrow_nemo.sparse.speculative_cost import (
    AcceptanceTable,
    SpeculativeCostModel,
    SpeculativePlan,
    expected_tokens_per_verify,
    pick_plan,
)

COST = SpeculativeCostModel(DecodeCostModel.for_preset("qwen3-1.7b", "h200"), page_size=16)
CANDIDATES = [512, 1024, 2048, 4096]


def test_expected_tokens_per_verify_is_the_truncated_geometric_sum() -> None:
    alpha = torch.tensor([0.0, 0.3, 0.9, 0.97, 1.0])
    for k in (0, 1, 4, 8):
        want = torch.stack([sum(a**i for i in range(k + 1)) for a in alpha.double()])
        torch.testing.assert_close(expected_tokens_per_verify(alpha, k), want)
    # and by simulation: accept each of k drafts with probability alpha until the first rejection, + 1 token
    gen = torch.Generator().manual_seed(0)
    draws = torch.rand(200_000, 8, generator=gen) < 0.9
    emitted = torch.cumprod(draws.int(), dim=1).sum(1) + 1
    assert abs(float(emitted.double().mean()) - float(expected_tokens_per_verify(0.9, 8))) < 0.02


def test_one_token_verify_is_one_dense_step_so_k0_is_no_speedup() -> None:
    lengths = torch.tensor([100, 5_000, 32_000])
    torch.testing.assert_close(
        COST.verify_s(lengths, torch.tensor(1), torch.tensor(64)),
        COST.dense_step_s(lengths + 1, torch.tensor(64)),
    )
    speed = COST.speedup(0.5, lengths, torch.tensor(1024), torch.tensor(0), torch.tensor(64))
    torch.testing.assert_close(speed, torch.ones(3, dtype=torch.float64))


def test_speculation_pays_at_long_context_and_not_at_short() -> None:
    """METHOD.md's estimate: alpha ~0.97, k = 8, a 10 % draft at 32K -> about 3x (2.5-3.5 here); at 1K
    the weights dominate a step, so a draft costs about a dense step and nothing beats dense decoding."""
    batch = torch.tensor(64)
    long = COST.speedup(0.97, torch.tensor(32_000), torch.tensor(3328), torch.tensor(8), batch)
    assert 2.5 < float(long) < 3.5
    short = COST.speedup(0.97, torch.tensor(1_000), torch.tensor(512), torch.arange(1, 9), batch)
    assert float(short.max()) < 1.1
    more_alpha = COST.speedup(
        torch.tensor([0.8, 0.9, 0.99]), torch.tensor(32_000), torch.tensor(3328), 8, batch
    )
    assert bool((more_alpha.diff() > 0).all())


def _table(alpha: dict[tuple[int, int], float], bin_tokens: int = 2000) -> AcceptanceTable:
    table = AcceptanceTable(bin_tokens, decay=0.5)
    lengths, budgets, values = [], [], []
    for (b, budget), a in alpha.items():
        lengths += [b * bin_tokens + 7] * 10
        budgets += [budget] * 10
        values += [a] * 10
    table.update(torch.tensor(lengths), torch.tensor(budgets), torch.tensor(values))
    return table


def test_acceptance_table_means_decay_and_optimistic_bounds() -> None:
    table = _table({(0, 1024): 0.9, (1, 512): 0.6})
    assert table.measured(0, 1024) == pytest.approx(0.9)
    table.update(torch.tensor([5, 6]), torch.tensor([1024, 1024]), torch.tensor([0.5, 0.5]))
    assert table.measured(0, 1024) == pytest.approx(
        (0.9 * 10 * 0.5 + 1.0) / (10 * 0.5 + 2)
    )  # old data halved
    est = table.estimates(3, CANDIDATES)
    assert est[0][512] == pytest.approx(table.measured(0, 1024))  # bounded by the next larger measured budget
    assert est[0][2048] == 1.0  # nothing known above: optimistic
    assert est[1][512] == pytest.approx(0.6)  # measured
    assert est[1][1024] == pytest.approx(table.measured(0, 1024))  # bounded by the shorter bin
    assert est[2][512] == pytest.approx(0.6)  # an unseen bin inherits the previous bin's estimates
    clone = AcceptanceTable(1)
    clone.load_state_dict(table.state_dict())
    assert clone.estimates(3, CANDIDATES) == est


def test_pick_plan_is_the_best_measured_choice_per_bin_with_budgets_non_decreasing() -> None:
    alpha = {(b, budget): a for b in range(4) for budget, a in zip(CANDIDATES, (0.55, 0.8, 0.95, 0.99))}
    plan = pick_plan(COST, _table(alpha), 4, CANDIDATES, max_draft_tokens=10, batch=64)
    assert list(plan.budgets) == sorted(plan.budgets)
    for i in range(4):  # brute force over (budget, k) under the same monotonicity constraint
        floor = plan.budgets[i - 1] if i else 0
        length = torch.tensor(int((i + 0.5) * 2000))
        best = max(
            (
                float(
                    COST.speedup(alpha[(i, b)], length, torch.tensor(b), torch.tensor(k), torch.tensor(64))
                ),
                -k,
                -b,
            )
            for b in CANDIDATES
            if b >= floor
            for k in range(11)
        )
        if best[0] > 1.0:
            assert (plan.budgets[i], plan.draft_tokens[i]) == (-best[2], -best[1])
            assert plan.predicted[i] == pytest.approx(best[0])
        else:
            assert plan.draft_tokens[i] == 0
    assert plan.draft_tokens[0] == 0  # 1K tokens: dense decoding wins
    assert plan.draft_tokens[3] > 0 and plan.predicted[3] > 1.2  # 7K tokens: speculation pays


def test_pick_plan_tries_an_untried_budget_once_then_keeps_the_measured_best() -> None:
    table = _table({(5, 2048): 0.95})  # one measured cell, in the bin of 10-12K tokens
    first = pick_plan(COST, table, 6, CANDIDATES, 8, 64)
    assert first.budgets[5] < 2048  # optimism: a smaller budget might accept as well and costs less
    tried = first.budgets[5]
    table.update(torch.tensor([5 * 2000 + 1] * 50), torch.tensor([tried] * 50), torch.tensor([0.2] * 50))
    second = pick_plan(COST, table, 6, CANDIDATES, 8, 64)
    assert second.budgets[5] != tried  # it accepted badly: not again


def test_predicted_rollout_speedup_matches_the_per_token_model() -> None:
    plan = SpeculativePlan(bin_tokens=2000, budgets=(512, 1024, 2048), draft_tokens=(0, 4, 8))
    lengths, prompts = [30_000] * 8, [500] * 8
    speed = COST.predicted_speedup(plan, [0.9, 0.95, 0.97], lengths, prompts)
    assert 1.5 < speed < 3.5
    never = SpeculativePlan(bin_tokens=2000, budgets=(512,), draft_tokens=(0,))
    assert COST.predicted_speedup(never, [0.9], lengths, prompts) == pytest.approx(1.0)
    # equal to the per-token sum written out for a batch whose sequences all stay live
    cached = torch.arange(500, 30_500)
    k, budget = plan.k_for(cached), plan.budgets_for(cached)
    alpha = torch.tensor([0.9, 0.95, 0.97], dtype=torch.float64)[(cached // 2000).clamp(max=2)]
    dense = COST.dense_step_s(cached + 1, torch.tensor(8)).sum()
    spec = (COST.round_s(cached, budget, k, torch.tensor(8)) / expected_tokens_per_verify(alpha, k)).sum()
    assert speed == pytest.approx(float(dense / spec), rel=1e-9)
    with pytest.raises(ValueError, match="predicted_speedup"):
        COST.predicted_speedup(plan, [], lengths, prompts)


def test_draft_steps_follow_the_sparse_reads_of_the_decode_model() -> None:
    lengths = torch.tensor([300, 8_000, 40_000])
    schedule = BudgetSchedule(bin_tokens=1, budgets=(1024,), page_size=16)
    read, scored = COST.decode.sparse_reads(lengths, schedule)
    want = COST.decode.step_cost(
        lengths[:, None], read[:, None], scored[:, None], torch.full((3, 1), 64)
    ).total_s
    torch.testing.assert_close(COST.draft_step_s(lengths, torch.tensor(1024), torch.tensor(64)), want)
