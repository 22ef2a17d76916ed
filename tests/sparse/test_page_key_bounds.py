"""The ``minmax`` page score (per-page key bounds, after Quest) against plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow_nemo.sparse.attention import (
    key_bound_scores,
    page_key_bounds,
    select_pages,
    select_pages_from_key_bounds,
    sparse_decode_attention,
)
from sparrow_nemo.sparse.pattern import SparsePattern


def ref_select_minmax(q, k, seq_len, budget, page_size, sink, local):
    """list[b][h] -> sorted kept pages, scoring each middle page by sum_d max(q_d min_d, q_d max_d)."""
    batch, hkv, _, dim = k.shape
    group = q.shape[1] // hkv
    result = []
    for b in range(batch):
        n = math.ceil(int(seq_len[b]) / page_size)
        budget_pages = budget // page_size
        rows = []
        for h in range(hkv):
            if n <= budget_pages:
                rows.append(list(range(n)))
                continue
            qm = sum(q[b, h * group + g].double() for g in range(group)) / group
            forced = {p for p in range(n) if p < sink or p >= n - local}

            def score(p, b=b, h=h, qm=qm):
                toks = [t for t in range(p * page_size, (p + 1) * page_size) if t < int(seq_len[b])]
                keys = k[b, h, toks].double()  # [n_tok, D]
                lo, hi = keys.min(0).values, keys.max(0).values
                return float(sum(max(qm[d] * lo[d], qm[d] * hi[d]) for d in range(dim)))

            middle = sorted((p for p in range(n) if p not in forced), key=lambda p: (-score(p), p))
            rows.append(sorted(forced | set(middle[: max(budget_pages - sink - local, 0)])))
        result.append(rows)
    return result


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    budget=st.integers(0, 120),
    page_size=st.sampled_from([1, 4, 16]),
    sink=st.integers(0, 2),
    local=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_minmax_selection_matches_the_loop_reference(lens, budget, page_size, sink, local, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), 4, 4, generator=gen)
    k = torch.randn(len(lens), 2, 90, 4, generator=gen)
    seq_len = torch.tensor(lens)
    idx = select_pages(q, k, seq_len, budget, page_size, sink, local, page_score="minmax")
    got = [[[int(p) for p in row if p >= 0] for row in per_b] for per_b in idx]
    assert got == ref_select_minmax(q, k, seq_len, budget, page_size, sink, local)


def test_the_bound_is_an_upper_bound_and_tight_for_one_key_pages():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 64, 8, generator=gen)
    seq_len = torch.tensor([64, 29])
    q_mean = torch.randn(2, 3, 8, generator=gen)
    k_min, k_max = page_key_bounds(k, seq_len, page_size=8)
    bound = key_bound_scores(q_mean, k_min, k_max)  # [2, 3, 8]
    for b in range(2):
        for p in range(math.ceil(int(seq_len[b]) / 8)):
            toks = slice(p * 8, min((p + 1) * 8, int(seq_len[b])))
            best = (k[b, :, toks] @ q_mean[b, :, :, None]).squeeze(-1).max(-1).values  # [Hkv]
            assert (bound[b, :, p] >= best - 1e-5).all()
    one = page_key_bounds(k, seq_len, page_size=1)
    exact = (k * q_mean[:, :, None, :]).sum(-1)
    assert torch.allclose(key_bound_scores(q_mean, *one)[0], exact[0], atol=1e-5)


def test_partial_and_empty_pages():
    k = torch.arange(40, dtype=torch.float32).view(1, 1, 40, 1).expand(2, 1, 40, 1).contiguous()
    k_min, k_max = page_key_bounds(k, torch.tensor([18, 0]), page_size=16)
    assert k_min.shape == k_max.shape == (2, 1, 3, 1)
    assert k_min[0, 0, :, 0].tolist() == [0.0, 16.0, 0.0] and k_max[0, 0, :, 0].tolist() == [15.0, 17.0, 0.0]
    assert k_min[1].abs().sum() == 0 and k_max[1].abs().sum() == 0


def test_one_needed_key_among_many_is_found_by_the_bound_not_the_mean():
    """Page 2 holds one key aligned with the query among keys pointing away; page 3 is mildly aligned."""
    dim, page = 2, 4
    k = torch.zeros(1, 1, 8 * page, dim)
    k[0, 0, 2 * page : 3 * page] = torch.tensor([-1.0, 0.0])
    k[0, 0, 2 * page + 1] = torch.tensor([3.0, 0.0])  # the needle: q . k = 3
    k[0, 0, 3 * page : 4 * page] = torch.tensor([0.5, 0.0])  # q . k = 0.5 everywhere
    q = torch.tensor([[[1.0, 0.0]]])
    seq_len, budget = torch.tensor([32]), 4 * page  # sink + 2 local + one chosen page
    assert select_pages(q, k, seq_len, budget, page).tolist() == [[[0, 3, 6, 7]]]  # centroid: 0.5 > 0
    assert select_pages(q, k, seq_len, budget, page, page_score="minmax").tolist() == [[[0, 2, 6, 7]]]
    out = sparse_decode_attention(q, k, k, seq_len, budget, page, page_score="minmax")
    assert out[0, 0, 0] > 1.0  # the needle's value dominates


def test_stored_bounds_select_as_the_cache_does_and_bad_inputs_name_the_tensor():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 2, 100, 8, generator=gen)
    seq_len = torch.tensor([100, 61])
    k_min, k_max = page_key_bounds(k, seq_len)
    spare = torch.full((2, 2, 2, 8), 9.0)  # pages past every sequence must be ignored
    got = select_pages_from_key_bounds(
        q, torch.cat([k_min, -spare], 2), torch.cat([k_max, spare], 2), seq_len, 64
    )
    assert torch.equal(got, select_pages(q, k, seq_len, 64, page_score="minmax"))
    with pytest.raises(ValueError, match="k_max shape"):
        select_pages_from_key_bounds(q, k_min, k_max[:, :1], seq_len, 64)
    with pytest.raises(ValueError, match="P=6 pages"):
        select_pages_from_key_bounds(q, k_min[:, :, :6], k_max[:, :, :6], seq_len, 64)
    with pytest.raises(ValueError, match="page_score"):
        select_pages(q, k, seq_len, 64, page_score="quest")


def test_the_knob_names_the_choices():
    assert SparsePattern(page_score="minmax").pattern().page_score == "minmax"
    with pytest.raises(ValueError, match=r"page_score.*centroid.*minmax"):
        SparsePattern(page_score="max")
