"""Sparse decode attention vs brute-force Python-loop references (and torch SDPA for the dense case).

Tolerances: float32 inputs; attention outputs compared at atol 1e-5 against a float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow_nemo.sparse.attention import (
    decode_attention,
    page_centroids,
    select_pages,
    select_pages_from_centroids,
    selected_page_count,
    selected_token_mask,
    sparse_decode_attention,
)


# ----- brute-force references (plain loops, independent of the vectorised code) -------------
def ref_centroids(k, seq_len, page_size):
    batch, hkv, length, dim = k.shape
    num_pages = math.ceil(length / page_size)
    out = torch.zeros(batch, hkv, num_pages, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(hkv):
            for p in range(num_pages):
                toks = [t for t in range(p * page_size, (p + 1) * page_size) if t < int(seq_len[b])]
                if toks:
                    out[b, h, p] = sum(k[b, h, t].double() for t in toks) / len(toks)
    return out


def ref_select(q, k, seq_len, budget, page_size, sink, local):
    """list[b][h] -> sorted list of kept page indices."""
    batch, hkv, _, _ = k.shape
    group = q.shape[1] // hkv
    cents = ref_centroids(k, seq_len, page_size)
    result = []
    for b in range(batch):
        n = math.ceil(int(seq_len[b]) / page_size)
        budget_pages = int(budget[b]) // page_size
        rows = []
        for h in range(hkv):
            if n <= budget_pages:
                rows.append(list(range(n)))
                continue
            forced = {p for p in range(n) if p < sink or p >= n - local}
            qm = sum(q[b, h * group + g].double() for g in range(group)) / group
            middle = [p for p in range(n) if p not in forced]
            scored = sorted(middle, key=lambda p: (-float(qm @ cents[b, h, p]), p))
            top_k = max(budget_pages - sink - local, 0)
            rows.append(sorted(forced | set(scored[:top_k])))
        result.append(rows)
    return result


def ref_attention(q, k, v, seq_len, kept, page_size):
    batch, hq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    out = torch.zeros(batch, hq, dim, dtype=torch.float64)
    for b in range(batch):
        for hh in range(hq):
            h = hh // group
            toks = [t for t in range(int(seq_len[b])) if t // page_size in kept[b][h]]
            logits = torch.stack([q[b, hh].double() @ k[b, h, t].double() for t in toks]) / math.sqrt(dim)
            w = torch.softmax(logits, dim=0)
            out[b, hh] = sum(w[i] * v[b, h, t].double() for i, t in enumerate(toks))
    return out


def unpad(page_idx):
    return [[[int(p) for p in row if p >= 0] for row in per_b] for per_b in page_idx]


CASES = [
    # batch, hq, hkv, dim, length, seq_lens, budgets, page_size, sink, local
    (2, 4, 2, 8, 100, [100, 37], [48, 48], 16, 1, 2),
    (3, 6, 3, 4, 64, [64, 5, 50], [32, 16, 1000], 8, 1, 2),
    (2, 8, 2, 16, 130, [130, 129], [64, 0], 16, 1, 2),
    (1, 2, 1, 8, 96, [96], [40], 8, 2, 1),
    (2, 4, 4, 8, 80, [80, 17], [24, 24], 4, 0, 0),
]


@pytest.mark.parametrize("case", CASES)
def test_against_brute_force(case):
    batch, hq, hkv, dim, length, lens, budgets, page_size, sink, local = case
    q = torch.randn(batch, hq, dim)
    k = torch.randn(batch, hkv, length, dim)
    v = torch.randn(batch, hkv, length, dim)
    seq_len = torch.tensor(lens)
    budget = torch.tensor(budgets)

    cents = page_centroids(k, seq_len, page_size)
    assert cents.dtype == torch.float32
    torch.testing.assert_close(cents.double(), ref_centroids(k, seq_len, page_size), atol=1e-6, rtol=1e-6)

    idx = select_pages(q, k, seq_len, budget, page_size, sink, local)
    assert idx.dtype == torch.int64 and idx.shape[:2] == (batch, hkv)
    expected = ref_select(q, k, seq_len, budget, page_size, sink, local)
    assert unpad(idx) == expected
    assert idx.shape[2] == max(len(r) for rows in expected for r in rows)
    counts = selected_page_count(seq_len, budget, page_size, sink, local)
    assert counts.tolist() == [len(rows[0]) for rows in expected]

    out = sparse_decode_attention(q, k, v, seq_len, budget, page_size, sink, local)
    assert out.shape == (batch, hq, dim) and out.dtype == q.dtype
    torch.testing.assert_close(
        out.double(), ref_attention(q, k, v, seq_len, expected, page_size), atol=1e-5, rtol=1e-5
    )


def test_sparse_differs_from_dense_when_pages_are_dropped():
    """Guard against a selection that is silently ignored."""
    q, k, v = torch.randn(1, 4, 8), torch.randn(1, 2, 256, 8), torch.randn(1, 2, 256, 8)
    seq_len = torch.tensor([256])
    sparse = sparse_decode_attention(q, k, v, seq_len, 64)
    dense = sparse_decode_attention(q, k, v, seq_len, 256)
    assert (sparse - dense).abs().max() > 1e-3


def test_budget_covering_sequence_equals_sdpa():
    """Independent dense reference: torch SDPA with GQA-expanded K/V over each prefix."""
    batch, hq, hkv, dim, length = 3, 8, 2, 16, 75
    q = torch.randn(batch, hq, dim)
    k, v = torch.randn(batch, hkv, length, dim), torch.randn(batch, hkv, length, dim)
    seq_len = torch.tensor([75, 40, 1])
    for budget in (80, torch.tensor([80, 48, 16]), 10**9):
        out = sparse_decode_attention(q, k, v, seq_len, budget)
        for b in range(batch):
            n = int(seq_len[b])
            kk = k[b, :, :n].repeat_interleave(hq // hkv, dim=0)
            vv = v[b, :, :n].repeat_interleave(hq // hkv, dim=0)
            ref = torch.nn.functional.scaled_dot_product_attention(q[b, :, None], kk, vv)[:, 0]
            torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-5)


def test_garbage_past_seq_len_is_ignored():
    """Preallocated caches hold anything past seq_len; it must not leak into scores or outputs."""
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 64, 8), torch.randn(2, 2, 64, 8)
    seq_len = torch.tensor([40, 17])
    clean = sparse_decode_attention(q, k, v, seq_len, 32)
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(seq_len.tolist()):
        k2[b, :, n:], v2[b, :, n:] = math.nan, math.inf
    assert torch.equal(select_pages(q, k2, seq_len, 32), select_pages(q, k, seq_len, 32))
    assert torch.equal(sparse_decode_attention(q, k2, v2, seq_len, 32), clean)


def test_ties_pick_lower_page_index():
    k = torch.ones(1, 1, 160, 4)  # every centroid equal -> every middle score equal
    q = torch.randn(1, 2, 4)
    idx = select_pages(q, k, torch.tensor([160]), budget_tokens=6 * 16)
    assert idx.tolist() == [[[0, 1, 2, 3, 8, 9]]]


def test_gqa_group_mean_decides_selection():
    """Page 3's keys align with the mean of the two queries although each query alone prefers page 2."""
    dim, page = 2, 4
    k = torch.zeros(1, 1, 8 * page, dim)
    k[0, 0, 2 * page : 3 * page] = torch.tensor([1.0, -0.9])
    k[0, 0, 3 * page : 4 * page] = torch.tensor([0.6, 0.6])
    q = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    assert select_pages(q, k, torch.tensor([32]), 4 * page, page).tolist() == [[[0, 2, 6, 7]]]
    q = torch.tensor([[[1.0, 1.0], [0.0, 1.0]]])  # mean (0.5, 1.0): page 3 scores 0.9, page 2 scores 0.05
    assert select_pages(q, k, torch.tensor([32]), 4 * page, page).tolist() == [[[0, 3, 6, 7]]]


def test_selection_from_stored_centroids():
    """The paged cache path: incrementally averaged centroids, with spare pages past seq_len."""
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 100, 8)
    seq_len = torch.tensor([100, 61])
    cents = torch.zeros(2, 2, 9, 8)
    for b in range(2):
        for t in range(int(seq_len[b])):  # c <- c + (k - c) / (n + 1)
            p, n = divmod(t, 16)
            cents[b, :, p] += (k[b, :, t] - cents[b, :, p]) / (n + 1)
    cents[:, :, 7:] = 5.0  # pages past every sequence must be ignored
    got = select_pages_from_centroids(q, cents, seq_len, 64)
    assert torch.equal(got, select_pages(q, k, seq_len, 64))
    with pytest.raises(ValueError, match="P=6 pages"):
        select_pages_from_centroids(q, cents[:, :, :6], seq_len, 64)


def test_partial_last_page_centroid_and_empty_pages():
    k = torch.arange(2 * 1 * 40 * 1, dtype=torch.float32).view(2, 1, 40, 1)
    c = page_centroids(k, torch.tensor([18, 0]), page_size=16)
    assert c.shape == (2, 1, 3, 1)
    assert c[0, 0, :, 0].tolist() == [7.5, 16.5, 0.0]  # page 1 holds tokens 16, 17 only
    assert c[1].abs().sum() == 0


def test_selected_token_mask_brute_force():
    page_idx = torch.tensor([[[0, 2, -1], [1, 2, 3]], [[3, -1, -1], [0, -1, -1]]])
    seq_len = torch.tensor([30, 27])
    mask = selected_token_mask(page_idx, seq_len, max_len=32, page_size=8)
    for b in range(2):
        for h in range(2):
            for t in range(32):
                want = t < int(seq_len[b]) and (t // 8) in page_idx[b, h].tolist()
                assert bool(mask[b, h, t]) == want


def test_low_precision_output_dtype():
    q = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 64, 8, dtype=torch.bfloat16), torch.randn(2, 2, 64, 8, dtype=torch.bfloat16)
    seq_len = torch.tensor([64, 20])
    out = sparse_decode_attention(q, k, v, seq_len, 32)
    ref = sparse_decode_attention(q.float(), k.float(), v.float(), seq_len, 32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 90), min_size=1, max_size=3),
    budget=st.integers(0, 120),
    page_size=st.sampled_from([1, 4, 16]),
    sink=st.integers(0, 2),
    local=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_selection_properties(lens, budget, page_size, sink, local, seed):
    gen = torch.Generator().manual_seed(seed)
    batch = len(lens)
    q = torch.randn(batch, 4, 4, generator=gen)
    k = torch.randn(batch, 2, 90, 4, generator=gen)
    seq_len = torch.tensor(lens)
    idx = select_pages(q, k, seq_len, budget, page_size, sink, local)
    assert unpad(idx) == ref_select(q, k, seq_len, torch.full((batch,), budget), page_size, sink, local)
    counts = selected_page_count(seq_len, budget, page_size, sink, local)
    for b, n_tok in enumerate(lens):
        n = math.ceil(n_tok / page_size)
        for h in range(2):
            row = [int(p) for p in idx[b, h] if p >= 0]
            assert len(row) == int(counts[b]) and row == sorted(set(row))
            assert all(0 <= p < n for p in row)
            assert set(range(min(sink, n))) | set(range(max(n - local, 0), n)) <= set(row)
            assert (idx[b, h, len(row) :] == -1).all()
            if n > budget // page_size:
                assert len(row) <= max(budget // page_size, min(n, sink + local))


def test_bad_inputs_name_the_tensor():
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 32, 8)
    with pytest.raises(ValueError, match="seq_len"):
        select_pages(q, k, torch.tensor([40, 3]), 16)
    with pytest.raises(ValueError, match="multiple"):
        select_pages(torch.randn(2, 3, 8), k, torch.tensor([4, 3]), 16)
    with pytest.raises(ValueError, match="q "):
        select_pages(torch.randn(2, 4, 7), k, torch.tensor([4, 3]), 16)
    with pytest.raises(ValueError, match="budget_tokens"):
        select_pages(q, k, torch.tensor([4, 3]), -1)
    with pytest.raises(ValueError, match="budget_tokens"):
        select_pages(q, k, torch.tensor([4, 3]), torch.tensor([16, 16, 16]))
    with pytest.raises(ValueError, match="page_size"):
        page_centroids(k, torch.tensor([4, 3]), 0)
    with pytest.raises(ValueError, match="seq_len >= 1"):
        sparse_decode_attention(q, k, k, torch.tensor([4, 0]), 16)
    with pytest.raises(ValueError, match="page_idx"):
        selected_token_mask(torch.tensor([[[5]]]), torch.tensor([8]), max_len=16, page_size=8)
    with pytest.raises(ValueError, match="no position"):
        decode_attention(q, k, k, torch.zeros(2, 2, 32, dtype=torch.bool))
