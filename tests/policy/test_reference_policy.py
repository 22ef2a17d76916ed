"""The KL penalty's frozen reference: the initial weights swapped into the training model for one pass."""

from __future__ import annotations

import pytest
import torch

from policy._scenarios import SETTINGS, make_batches, pg_loss
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.lora import LoraConfig
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy


def test_reference_logprobs_are_the_initial_policys_and_the_trained_weights_come_back(single_rank) -> None:
    policy = MegatronPolicy(PRESETS["tiny-test"], ParallelLayout(), SETTINGS, "float32", seed=5)
    batches = make_batches(PRESETS["tiny-test"].vocab_size)
    with pytest.raises(RuntimeError, match="keep_reference"):
        policy.reference_logprobs(batches)
    policy.keep_reference()
    initial = policy.logprobs(batches)
    policy.train_step(batches, pg_loss)
    policy.train_step(batches, pg_loss)
    trained = policy.logprobs(batches)
    assert all((a.logprobs - b.logprobs).abs().max() > 1e-3 for a, b in zip(initial, trained))
    policy.enable_lora(LoraConfig(rank=2))  # parameters added after the snapshot stay as they are
    reference = policy.reference_logprobs(batches)
    for ref, first in zip(reference, initial):
        assert torch.equal(ref.logprobs, first.logprobs) and torch.equal(ref.topk_ids, first.topk_ids)
    for after, before in zip(policy.logprobs(batches), trained):  # the swap back is bit-exact
        assert torch.equal(after.logprobs, before.logprobs)
