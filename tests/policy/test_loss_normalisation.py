"""The GRPO loss of an optimizer step is normalised by the step's counts: the loss, its metrics and its
gradient do not depend on micro-batch size, data-parallel size or pipeline schedule.

A fixed step batch (8 sequences of 1-10 response tokens; TIS, KL and both clip sides active) is updated once
by ``update_policy`` in one process with micro-batches of 1, 2 and 8 rows and in 2 gloo processes at DP2,
PP2 and TP2. Tolerance: fp32 with different summation orders, ``rtol=1e-4, atol=1e-6`` on every gradient
element and ``1e-5`` relative on the loss and metrics. The per-micro-batch-mean normalisation the recipes
had before (``micro_batch_size: 1`` made it a sequence mean) is run for contrast: it moves with the
micro-batch size by far more than the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from policy._helpers import free_port, make_hf_checkpoint, run_distributed, single_rank_env
from policy._update_scenarios import SHAPE, per_micro_batch_mean_loss, two_rank_suite, update_once
from sparrow_nemo.grpo.losses import PolicyLossConfig

LOSSES = {
    "token_mean": PolicyLossConfig(correction="tis", kl_coef=0.1, tis_cap=1.5),
    "seq_mean_token_mean": PolicyLossConfig(
        correction="tis", kl_coef=0.1, tis_cap=1.5, aggregation="seq_mean_token_mean"
    ),
}
#: (tp, pp, micro_batch_size) of the 2-process runs; DP is what remains of the 2 ranks
TWO_RANK = {"dp2": (1, 1, 2), "pp2": (1, 2, 1), "tp2": (2, 1, 4)}
ONE_RANK_MICRO = (1, 2, 8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loss_norm")
    ckpt = str(make_hf_checkpoint(SHAPE, root / "hf"))
    out: dict = {}
    for agg, loss in LOSSES.items():
        for micro in ONE_RANK_MICRO:
            with single_rank_env():
                update_once(0, 1, 1, micro, ckpt, loss, str(root / f"{agg}_mb{micro}.pt"))
            out[agg, f"mb{micro}"] = torch.load(root / f"{agg}_mb{micro}.pt", weights_only=False)
    for micro in (1, 4):
        with single_rank_env():
            per_micro_batch_mean_loss(0, micro, ckpt, LOSSES["token_mean"], str(root / f"old_mb{micro}.pt"))
        out["old", f"mb{micro}"] = torch.load(root / f"old_mb{micro}.pt", weights_only=False)
    jobs = [
        ("update_once", free_port(), (tp, pp, micro, ckpt, loss, str(root / f"{agg}_{name}.pt")))
        for agg, loss in LOSSES.items()
        for name, (tp, pp, micro) in TWO_RANK.items()
        if agg == "token_mean" or name == "dp2"
    ]
    run_distributed(two_rank_suite, 2, jobs)
    for agg in LOSSES:
        for name in TWO_RANK:
            if (root / f"{agg}_{name}.pt").exists():
                out[agg, name] = torch.load(root / f"{agg}_{name}.pt", weights_only=False)
    return out


def _assert_same_step(got: dict, ref: dict) -> None:
    assert got["updated"] and ref["updated"]
    assert set(got["metrics"]) == set(ref["metrics"])
    for key, value in ref["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert set(got["grads"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.multiproc
@pytest.mark.parametrize("aggregation", list(LOSSES))
@pytest.mark.parametrize("micro", [m for m in ONE_RANK_MICRO if m != 8])
def test_micro_batch_size_does_not_change_loss_or_gradient(runs, aggregation, micro):
    _assert_same_step(runs[aggregation, f"mb{micro}"], runs[aggregation, "mb8"])


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("aggregation", "layout"), [("token_mean", n) for n in TWO_RANK] + [("seq_mean_token_mean", "dp2")]
)
def test_parallel_layout_does_not_change_loss_or_gradient(runs, aggregation, layout):
    _assert_same_step(runs[aggregation, layout], runs[aggregation, "mb8"])


@pytest.mark.multiproc
def test_the_fixed_batch_exercises_what_is_checked(runs):
    ref = runs["token_mean", "mb8"]["metrics"]
    assert 0.1 < ref["train/clip_fraction"] < 0.9, ref  # both branches of the clipped surrogate
    assert ref["train/kl"] > 1e-3 and ref["train/tis_clipped_fraction"] > 0.0, ref
    assert ref["train/ratio_min"] < 0.8 and ref["train/ratio_max"] > 1.28, ref
    # token mean and sequence mean differ on this batch, so the two aggregations are really distinct
    seq = runs["seq_mean_token_mean", "mb8"]["metrics"]["train/loss"]
    assert abs(seq - ref["train/loss"]) > 1e-3
    # the per-micro-batch mean (the old normalisation) moves with the micro-batch size
    old1, old4 = runs["old", "mb1"], runs["old", "mb4"]
    assert abs(old1["loss"] - old4["loss"]) > 1e-3
    name = "model.embed_tokens.weight"
    assert (old1["grads"][name] - old4["grads"][name]).abs().max() > 1e-3
