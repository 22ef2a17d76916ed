"""Acceptance rate, its top-k lower bound, tail by bin and summary metrics vs independent references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow_nemo.sparse.mismatch import (
    acceptance_rate,
    acceptance_rate_topk,
    binned_quantiles,
    summarize,
    tail_by_bin,
)


def random_logprobs(shape, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.log_softmax(scale * torch.randn(*shape, generator=gen, dtype=torch.float64), dim=-1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 50))
def test_acceptance_rate_is_one_minus_total_variation(seed, vocab):
    logp, logq = random_logprobs((3, vocab), seed), random_logprobs((3, vocab), seed + 1)
    alpha = acceptance_rate(logp, logq)
    tv = 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
    torch.testing.assert_close(alpha, 1 - tv, atol=1e-12, rtol=0)
    torch.testing.assert_close(alpha, acceptance_rate(logq, logp), atol=1e-12, rtol=0)  # symmetric
    assert ((alpha >= 0) & (alpha <= 1)).all()
    torch.testing.assert_close(acceptance_rate(logp, logp), torch.ones(3, dtype=torch.float64))


def test_acceptance_rate_disjoint_and_float32():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.0, 0.0]]))
    logq = torch.log(torch.tensor([[0.0, 0.0, 0.3, 0.7]]))
    assert acceptance_rate(logp, logq).item() == 0.0
    logp32 = torch.log_softmax(torch.randn(4, 7), -1)
    out = acceptance_rate(logp32, logp32)
    assert out.dtype == torch.float32 and torch.allclose(out, torch.ones(4))
    with pytest.raises(ValueError, match="same shape"):
        acceptance_rate(logp, logq[:, :3])


def topk_reference(p_ids, p_lp, q_ids, q_lp):
    """Union of both top-k sets; a token missing on one side counts 0 there."""
    p = {int(i): math.exp(float(v)) for i, v in zip(p_ids, p_lp) if i >= 0}
    q = {int(i): math.exp(float(v)) for i, v in zip(q_ids, q_lp) if i >= 0}
    return sum(min(p.get(v, 0.0), q.get(v, 0.0)) for v in set(p) | set(q))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), vocab=st.integers(3, 40), k=st.integers(1, 20), extra=st.integers(0, 5))
def test_topk_bound_matches_loop_reference_and_is_below_exact(seed, vocab, k, extra):
    k = min(k, vocab)
    logp, logq = random_logprobs((4, vocab), seed), random_logprobs((4, vocab), seed + 7)
    p_lp, p_ids = torch.topk(logp, k)
    q_lp, q_ids = torch.topk(logq, min(k + extra, vocab))  # the two lists may differ in length
    bound = acceptance_rate_topk(p_ids, p_lp, q_ids, q_lp)
    exact = acceptance_rate(logp, logq)
    for r in range(4):
        assert bound[r].item() == pytest.approx(
            topk_reference(p_ids[r], p_lp[r], q_ids[r], q_lp[r]), abs=1e-12
        )
    assert (bound <= exact + 1e-12).all()
    if k == vocab:
        torch.testing.assert_close(bound, exact, atol=1e-12, rtol=0)


def test_topk_identical_disjoint_and_padding():
    ids = torch.tensor([[5, 9, 2]])
    lp = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    assert acceptance_rate_topk(ids, lp, ids.flip(-1), lp.flip(-1)).item() == pytest.approx(1.0)
    assert acceptance_rate_topk(ids, lp, ids + 100, lp).item() == 0.0
    padded_ids = torch.tensor([[5, -1, -1]])
    padded_lp = torch.tensor([[math.log(0.6), -math.inf, -math.inf]])
    assert acceptance_rate_topk(padded_ids, padded_lp, padded_ids, padded_lp).item() == pytest.approx(0.6)
    none = torch.empty(1, 0, dtype=torch.int64)
    assert acceptance_rate_topk(ids, lp, none, none.float()).item() == 0.0  # an empty list shares nothing
    with pytest.raises(ValueError, match="repeats a token id"):
        acceptance_rate_topk(torch.tensor([[1, 1]]), lp[:, :2], ids[:, :2], lp[:, :2])
    with pytest.raises(ValueError, match="leading dims"):
        acceptance_rate_topk(ids, lp, ids.expand(2, 3), lp.expand(2, 3))


def test_tail_by_bin_matches_numpy_per_bin():
    gen = torch.Generator().manual_seed(3)
    alpha = torch.rand(5000, generator=gen)
    cached = torch.randint(0, 9000, (5000,), generator=gen)
    cached[cached // 2000 == 2] = 1000  # bin 2 left empty
    tail = tail_by_bin(alpha, cached, bin_tokens=2000, quantile=0.05)
    assert list(tail) == [0, 1, 3, 4]
    for b, value in tail.items():
        ref = np.quantile(alpha[cached // 2000 == b].numpy().astype(np.float64), 0.05)
        assert value == pytest.approx(ref, abs=1e-12)
    assert tail_by_bin(torch.empty(0), torch.empty(0, dtype=torch.int64)) == {}


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(st.floats(0, 1), min_size=1, max_size=60),
    q=st.floats(0, 1),
    nbins=st.integers(1, 4),
)
def test_binned_quantiles_property(values, q, nbins):
    vals = torch.tensor(values, dtype=torch.float64)
    bins = torch.arange(len(values)) % nbins
    ids, counts, table = binned_quantiles(vals, bins, (q,))
    for m, b in enumerate(ids.tolist()):
        group = vals[bins == b].numpy()
        assert counts[m] == len(group)
        assert table[0, m].item() == pytest.approx(np.quantile(group, q), abs=1e-12)


def test_summarize_metrics():
    alpha = torch.tensor([1.0, 0.9, 0.5, 0.99, 0.7, 0.8])
    cached = torch.tensor([10, 150, 199, 200, 390, 5000])
    m = summarize(alpha, cached, bin_tokens=200)
    a = alpha.double().numpy()
    assert m["acceptance/tokens"] == 6
    assert m["acceptance/mean"] == pytest.approx(a.mean())
    for key, level in (("p1", 0.01), ("p5", 0.05), ("p50", 0.5)):
        assert m[f"acceptance/{key}"] == pytest.approx(np.quantile(a, level))
    assert m["acceptance/mean/bin_0"] == pytest.approx((1.0 + 0.9 + 0.5) / 3)
    assert m["acceptance/p50/bin_1"] == pytest.approx((0.99 + 0.7) / 2)
    assert m["acceptance/tokens/bin_25"] == 1 and "acceptance/tokens/bin_2" not in m
    assert m["acceptance/min_p5"] == pytest.approx(
        min(np.quantile(a[:3], 0.05), np.quantile(a[3:5], 0.05), 0.8)
    )
    assert "gen_kl_error" not in m


def test_logprob_error_metrics():
    gen_lp = torch.tensor([-0.1, -2.0, -0.5])
    train_lp = torch.tensor([-0.2, -1.0, -0.5])
    m = summarize(torch.ones(3), torch.zeros(3, dtype=torch.int64), 2000, train_lp, gen_lp)
    assert m["token_mult_prob_error"] == pytest.approx((math.exp(0.1) + math.exp(1.0) + 1) / 3)
    d = [-0.1, 1.0, 0.0]
    assert m["gen_kl_error"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 3)
    same = summarize(torch.ones(3), torch.zeros(3, dtype=torch.int64), 2000, gen_lp, gen_lp)
    assert same["gen_kl_error"] == 0.0 and same["token_mult_prob_error"] == 1.0
    with pytest.raises(ValueError, match="both"):
        summarize(torch.ones(3), torch.zeros(3, dtype=torch.int64), 2000, train_lp, None)


def test_gen_kl_error_estimates_kl_of_gen_from_train():
    """Monte Carlo: k3 on tokens sampled from gen converges to KL(gen || train)."""
    gen_logp = torch.log(torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64))
    train_logp = torch.log(torch.tensor([0.3, 0.3, 0.3, 0.1], dtype=torch.float64))
    tokens = torch.multinomial(
        gen_logp.exp(), 200_000, replacement=True, generator=torch.Generator().manual_seed(1)
    )
    m = summarize(
        torch.ones(len(tokens)),
        torch.zeros(len(tokens), dtype=torch.int64),
        2000,
        train_logp[tokens],
        gen_logp[tokens],
    )
    exact = float((gen_logp.exp() * (gen_logp - train_logp)).sum())
    assert m["gen_kl_error"] == pytest.approx(exact, abs=3e-3)


def test_bad_token_inputs():
    with pytest.raises(ValueError, match="cached_len"):
        tail_by_bin(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match=r"\[N\]"):
        tail_by_bin(torch.ones(3), torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="bin_tokens"):
        summarize(torch.ones(1), torch.ones(1, dtype=torch.int64), bin_tokens=0)
    assert summarize(torch.empty(0), torch.empty(0, dtype=torch.int64)) == {"acceptance/tokens": 0.0}
