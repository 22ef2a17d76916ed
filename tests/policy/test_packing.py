"""Micro-batch formation (``policy/packing.py``): tokens, not padding; extras travel with their rows; the
outputs come back in the step's order; and the policy computes the same logprobs and loss either way."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.grpo.rollout_step import pad_pairs
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.packing import concat_outputs, micro_batches, row_groups


def _step(lengths: list[int], vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (3,), generator=g) for _ in lengths]
    responses = [torch.randint(0, vocab, (n - 3,), generator=g) for n in lengths]
    return pad_pairs(prompts, responses)


def test_row_count_mode_keeps_order_and_cuts_each_batch_to_its_longest_row():
    tokens, lengths, mask = _step([9, 4, 12, 5])
    extras = {"mask": mask, "adv": torch.arange(4.0), "budget": torch.arange(48).view(4, 12)}
    batches = micro_batches(tokens, lengths, extras, 2)
    assert [b.tokens.shape for b in batches] == [(2, 9), (2, 12)]
    assert torch.equal(batches[1].tokens, tokens[2:4, :12]) and torch.equal(batches[0].tokens, tokens[:2, :9])
    assert batches[0].extras["mask"].shape == (2, 8) and torch.equal(batches[0].extras["mask"], mask[:2, :8])
    assert torch.equal(batches[1].extras["adv"], torch.tensor([2.0, 3.0]))
    assert torch.equal(batches[0].extras["budget"], extras["budget"][:2, :9])  # [N, S] extras cut to w
    assert torch.equal(batches[1].placement.rows, torch.tensor([2, 3]))
    with pytest.raises(ValueError, match=r"not a multiple of policy\.micro_batch_size=3"):
        micro_batches(tokens, lengths, {}, 3)
    with pytest.raises(ValueError, match=r"extras\['bad'\] \(4, 5\): expected"):
        micro_batches(tokens, lengths, {"bad": torch.zeros(4, 5)}, 2)


def test_token_budget_groups_sorted_rows_with_little_padding():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(100, 4000, (64,), generator=g)
    groups = row_groups(lengths, 1, max_tokens=8192)
    assert sorted(torch.cat(groups).tolist()) == list(range(64))  # every row once
    tokens = padding = 0
    for rows in groups:
        width = int(lengths[rows].max())
        assert rows.numel() * width <= 8192
        tokens += int(lengths[rows].sum())
        padding += rows.numel() * width - int(lengths[rows].sum())
    assert padding < 0.1 * tokens  # sorted buckets: the rows of a micro-batch have similar lengths
    padded_step = 64 * int(lengths.max())  # the old layout: every row padded to the step's longest
    assert tokens + padding < 0.6 * padded_step
    assert len(row_groups(lengths, 1, max_tokens=8192, multiple_of=4)) % 4 == 0
    with pytest.raises(ValueError, match=r"does not fit policy\.max_tokens_per_micro_batch=1000"):
        row_groups(lengths, 1, max_tokens=1000)


def test_concat_outputs_puts_rows_back_in_step_order():
    tokens, lengths, _ = _step([9, 4, 12, 5, 7])
    batches = micro_batches(tokens, lengths, {}, 1, max_tokens=20)
    assert [b.placement.rows.tolist() for b in batches] != [[0], [1], [2], [3], [4]]  # reordered

    def fake(b):  # logprob = row index + position / 100 where a real token is predicted, [b, w-1]
        w = b.tokens.shape[1]
        lp = (b.placement.rows[:, None].float() + torch.arange(w - 1)[None] / 100) * b.target_mask()
        return LogprobOutput(
            lp, lp, torch.zeros(*lp.shape, 2, dtype=torch.long), torch.zeros(*lp.shape, 2), b.placement
        )

    full = concat_outputs([fake(b) for b in batches])
    assert full.logprobs.shape == (5, 11)
    for row, n in enumerate(lengths.tolist()):
        assert torch.allclose(full.logprobs[row, : n - 1], row + torch.arange(n - 1) / 100)
        assert (full.logprobs[row, n - 1 :] == 0).all()  # past the row (and its micro-batch's width)


def test_policy_logprobs_and_loss_are_the_same_packed_or_padded(single_rank):
    from sparrow_nemo.model_shapes import PRESETS
    from sparrow_nemo.policy.optim import OptimizerSettings
    from sparrow_nemo.policy.parallel import ParallelLayout
    from sparrow_nemo.policy.pipeline import run_microbatches
    from sparrow_nemo.policy.policy import MegatronPolicy

    shape = PRESETS["tiny-test"]
    policy = MegatronPolicy(shape, ParallelLayout(), OptimizerSettings(lr=1e-3), "float32")
    tokens, lengths, mask = _step([30, 7, 19, 12, 25, 9], vocab=shape.vocab_size, seed=1)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 0.8])
    one = micro_batches(tokens, lengths, {"mask": mask, "adv": adv}, 6)  # the whole step, padded to 30
    packed = micro_batches(tokens, lengths, {"mask": mask, "adv": adv}, 1, max_tokens=40)
    assert len(packed) > 1 and sum(b.tokens.numel() for b in packed) < tokens.numel()
    dense = concat_outputs(policy.logprobs(one))
    got = concat_outputs(policy.logprobs(packed))
    torch.testing.assert_close(got.logprobs[mask], dense.logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.entropy[mask], dense.entropy[mask], atol=1e-5, rtol=0)

    def token_sum(out, batch):  # sum over response tokens of adv * logprob: additive over micro-batches
        m = batch.extras["mask"].float()
        return (batch.extras["adv"][:, None] * out.logprobs * m).sum(), {}

    whole = run_microbatches(policy.model, policy.spec, one, token_sum, forward_only=True)
    parts = run_microbatches(policy.model, policy.spec, packed, token_sum, forward_only=True)
    assert sum(float(r[0]) for r in parts) == pytest.approx(float(whole[0][0]), abs=1e-4)
