"""Fault injection into the policy's train step: a NaN/inf loss or gradient skips the update on every rank.

A good step first (so AdamW has moments to protect), then a poisoned one: weights and optimizer state must
be bit-equal before and after, and the step result must name the offending statistic.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from policy._helpers import run_distributed, single_rank_env
from policy._scenarios import SETTINGS, make_batches, pg_loss

from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.pipeline import LossFn
from sparrow_nemo.policy.policy import MegatronPolicy


def nan_loss_in(calls: set[int], value: float = float("nan")) -> LossFn:
    """``pg_loss``, but the loss of the ``calls``-th micro-batches (0-based call count) is ``value``."""
    count = iter(range(1 << 30))

    def loss_fn(out: LogprobOutput, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = pg_loss(out, batch)
        return (loss * value if next(count) in calls else loss), metrics

    return loss_fn


def nan_gradient(out: LogprobOutput, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """A finite loss whose gradient is NaN: d sqrt(t)/dt = inf at t = 0, times the zero upstream gradient."""
    loss, metrics = pg_loss(out, batch)
    return loss + 0.0 * torch.sqrt(out.logprobs.sum() * 0.0), metrics


def snapshot(policy: MegatronPolicy) -> tuple[dict[str, torch.Tensor], dict]:
    """(parameters, optimizer state) deep-copied."""
    params = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    return params, copy.deepcopy(policy.optimizer.state_dict())


def assert_bit_equal(a, b, path: str = "") -> None:
    """Nested dicts / lists / tensors equal bit for bit (NaN == NaN)."""
    if isinstance(a, torch.Tensor):
        bits = (lambda t: t.reshape(-1).view(torch.uint8)) if a.is_floating_point() else (lambda t: t)
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_bit_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), (path, a, b)


@pytest.fixture
def policy() -> Iterator[MegatronPolicy]:
    """A one-rank tiny policy that has taken one good step."""
    with single_rank_env():
        p = MegatronPolicy(PRESETS["tiny-test"], ParallelLayout(), SETTINGS, "float32")
        good = p.train_step(make_batches(p.spec.shape.vocab_size, seed=1), pg_loss)
        assert good.skipped is None and math.isfinite(good.grad_norm)
        yield p
        p.close()


@pytest.mark.parametrize("value, word", [(float("nan"), "nan"), (float("inf"), "inf")])
def test_nonfinite_loss_in_one_micro_batch_skips_the_update(policy, value: float, word: str) -> None:
    before = snapshot(policy)
    batches = make_batches(policy.spec.shape.vocab_size, seed=2)
    result = policy.train_step(batches, nan_loss_in({2}, value))
    assert result.skipped == "loss"
    assert result.skip_detail == f"loss is {word} in micro-batch 2 of data-parallel rank 0"
    assert math.isnan(result.grad_norm)
    assert_bit_equal(snapshot(policy), before)
    # the next good step trains again (stale NaN gradients do not leak into it)
    after = policy.train_step(batches, pg_loss)
    assert after.skipped is None and math.isfinite(after.loss) and math.isfinite(after.grad_norm)
    params = dict(policy.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    assert any(not torch.equal(p, before[0][name]) for name, p in params.items())


def test_nonfinite_gradient_with_a_finite_loss_skips_the_update(policy) -> None:
    before = snapshot(policy)
    result = policy.train_step(make_batches(policy.spec.shape.vocab_size, seed=3), nan_gradient)
    assert math.isfinite(result.loss)
    assert result.skipped == "grad_norm" and result.skip_detail == "grad_norm is nan"
    assert_bit_equal(snapshot(policy), before)


def _dp2_poison_rank1(rank: int, out_dir: str) -> None:
    """DP=2: only rank 1's second micro-batch has a NaN loss; both ranks must skip."""
    layout = ParallelLayout.for_world(2)
    policy = MegatronPolicy(PRESETS["tiny-test"], layout, SETTINGS, "float32")
    batches = make_batches(policy.spec.shape.vocab_size)[rank * 2 : rank * 2 + 2]
    policy.train_step(batches, pg_loss)
    before = snapshot(policy)
    result = policy.train_step(batches, nan_loss_in({1} if rank == 1 else set()))
    after = snapshot(policy)
    torch.save({"result": result, "before": before, "after": after}, Path(out_dir) / f"rank{rank}.pt")
    policy.close()


@pytest.mark.multiproc
@pytest.mark.slow
def test_nonfinite_loss_on_one_data_parallel_rank_skips_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned ranks; not left behind for later tests
    run_distributed(_dp2_poison_rank1, 2, str(tmp_path))
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert saved["result"].skipped == "loss", rank
        assert saved["result"].skip_detail == "loss is nan in micro-batch 1 of data-parallel rank 1"
        assert_bit_equal(saved["after"], saved["before"])
