"""An infinite learning rate: finite loss and gradients, but the update makes the weights non-finite. The
train step names the first such parameter and the learning rate instead of training on NaN weights."""

from __future__ import annotations

import dataclasses
import math

import pytest
from policy._helpers import single_rank_env
from policy._scenarios import SETTINGS, make_batches, pg_loss

from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.parallel import ParallelLayout, destroy_parallel
from sparrow_nemo.policy.policy import MegatronPolicy
from sparrow_nemo.policy.train_step import NonFiniteWeightsError

SHAPE = PRESETS["tiny-test"]


def test_an_update_to_non_finite_weights_is_named() -> None:
    lr = math.inf  # (torch's AdamW refuses a NaN one itself)
    with single_rank_env():
        settings = dataclasses.replace(SETTINGS)
        # the recipe refuses a non-finite lr (OptimizerSettings checks it); force one past that check to
        # exercise the train step's own guard
        object.__setattr__(settings, "lr", lr)
        policy = MegatronPolicy(SHAPE, ParallelLayout(), settings, "float32")
        try:
            with pytest.raises(
                NonFiniteWeightsError, match=rf"first: parameter '.+' on rank 0.*learning rate {lr}"
            ):
                policy.train_step(make_batches(SHAPE.vocab_size), pg_loss)
        finally:
            destroy_parallel()


def test_a_normal_update_passes_the_check() -> None:
    with single_rank_env():
        policy = MegatronPolicy(SHAPE, ParallelLayout(), SETTINGS, "float32")
        try:
            result = policy.train_step(make_batches(SHAPE.vocab_size), pg_loss)
            assert result.skipped is None and math.isfinite(result.loss)
        finally:
            destroy_parallel()
