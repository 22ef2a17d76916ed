"""The step's mini-batches are the same GRPO groups at every data-parallel size (``update.mini_batch_order``)."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.grpo.process_model import RankPlan
from sparrow_nemo.grpo.update import mini_batch_order

PROMPTS, GROUP, MINI = 8, 3, 2


def _global_mini_batches(dp: int) -> list[set[int]]:
    """Step rows (prompt-major, ``GROUP`` per prompt) of each mini-batch, gathered over ``dp`` replicas."""
    out: list[set[int]] = [set() for _ in range(MINI)]
    for rank in range(dp):
        prompts = RankPlan(rank=rank, world=dp, dp_rank=rank, dp=dp).replica_prompts(PROMPTS)
        rows = torch.arange(prompts.start * GROUP, prompts.stop * GROUP)
        ordered = rows[mini_batch_order(len(rows), GROUP, MINI)]
        for m, piece in enumerate(ordered.chunk(MINI)):
            out[m] |= set(piece.tolist())
    return out


@pytest.mark.parametrize("dp", [2, 4])
def test_mini_batches_do_not_depend_on_the_data_parallel_size(dp):
    one = _global_mini_batches(1)
    assert _global_mini_batches(dp) == one
    for m, rows in enumerate(one):  # whole groups, every MINI-th one
        assert rows == {g * GROUP + j for g in range(m, PROMPTS, MINI) for j in range(GROUP)}


def test_order_is_a_permutation_of_whole_groups():
    order = mini_batch_order(12, 3, 2)
    assert sorted(order.tolist()) == list(range(12))
    assert order.tolist() == [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]


def test_groups_that_do_not_split_are_refused_with_the_keys():
    with pytest.raises(ValueError, match=r"grpo\.mini_batches_per_step=2 .*grpo\.prompts_per_step"):
        mini_batch_order(9, 3, 2)
