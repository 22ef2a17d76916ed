"""The fused score + select kernel (``page_selection``) against the method layer.

Selection must match ``select_pages_from_centroids`` on the same centroids exactly (same pages,
same order, -1 padding), for float32 and for bfloat16/float16 centroids, including the tie rule;
the physical ids must be the block table's; the budget is clamped on the device.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DecodeCase, check_selection, paged_from_contiguous, random_case
from sparrow_kernels import page_selection, select_pages_paged

from sparrow_nemo.sparse.attention import page_centroids

# Mixed lengths in one batch: a partial last page (77 = 4 pages + 13 tokens), exact pages (160),
# a one-page sequence (5), and budgets below, at and above the length (with 3 reserved pages).
SEQ_LENS = [77, 160, 5, 123]
BUDGETS = [48, 96, 16, 2048]


@pytest.mark.parametrize("group", [1, 4, 5])  # 5: Qwen3-14B (40 q heads, 8 KV heads)
def test_selection_matches_reference_for_gqa_ratios(device: torch.device, group: int) -> None:
    case = random_case(SEQ_LENS, BUDGETS, num_kv_heads=2, group=group, device=device, seed=group)
    check_selection(case, case.budget)


@pytest.mark.parametrize("centroid_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_centroids_match_reference_on_the_same_centroids(
    device: torch.device, centroid_dtype: torch.dtype
) -> None:
    """Centroids stored in the key dtype (half the bytes of float32): the selection equals the
    method layer's on the very same rounded centroids (read as stored, scored in float32)."""
    case = random_case([400, 333, 250], [96, 160, 48], num_kv_heads=2, group=4, dtype=centroid_dtype,
                       device=device, seed=9, centroid_dtype=centroid_dtype)  # fmt: skip
    check_selection(case, case.budget)
    check_selection(case, 64, sink_pages=2, local_pages=1)
    assert case.paged.centroids.dtype == centroid_dtype


def test_selection_budget_edge_cases(device: torch.device) -> None:
    """Budget 0 and budgets below the reserved pages keep sink + local only; a budget equal to the
    page count keeps all; a huge int (the dense schedule) keeps everything; int64 tensors larger
    than int32 and negative entries are clamped on the device."""
    case = random_case([200, 200, 200, 33], [0, 40, 208, 48], device=device, seed=7)
    check_selection(case, case.budget)
    check_selection(case, 2**40)
    c = case.paged
    huge = torch.tensor([2**40, -5, 2**33, 16], dtype=torch.int64, device=device)
    page_idx, counts = select_pages_paged(case.q, c.centroids, c.block_table, c.seq_len, huge)
    clamped = torch.tensor([2**20, 0, 2**20, 16], dtype=torch.int32, device=device)
    ref_idx, ref_counts = select_pages_paged(case.q, c.centroids, c.block_table, c.seq_len, clamped)
    assert torch.equal(page_idx, ref_idx) and torch.equal(counts, ref_counts)
    check_selection(case, clamped)
    check_selection(case, 80, sink_pages=2, local_pages=1)
    check_selection(case, 64, sink_pages=0, local_pages=0)


def test_int64_lengths_and_block_table(device: torch.device) -> None:
    """int64 seq_len / block_table (the engine's own dtypes) are read as they are: no host-side cast."""
    case = random_case(SEQ_LENS, BUDGETS, num_kv_heads=2, group=2, device=device, seed=12)
    c = case.paged
    ref = page_selection(case.q, c.centroids, c.block_table, c.seq_len, case.budget)
    wide = page_selection(case.q, c.centroids, c.block_table.long(), c.seq_len.long(), case.budget.long())
    assert torch.equal(wide.page_idx, ref.page_idx) and torch.equal(wide.counts, ref.counts)
    for b, h in ((0, 0), (1, 1), (3, 0)):
        n = int(ref.counts[b, h])
        assert torch.equal(wide.physical[b, h, :n], ref.physical[b, h, :n])


def test_selection_ties_go_to_the_lower_page(device: torch.device) -> None:
    """Pages with identical keys have identical centroids and scores; the top-k cut inside a tie
    group must keep the lowest page indices, as the reference's stable sort does."""
    case = random_case([192, 192], [0, 0], num_kv_heads=2, group=4, device=device, seed=3)
    k = case.k.clone()
    for page in (4, 6, 7, 9):  # four tied middle pages: copies of page 2
        k[:, :, page * 16 : (page + 1) * 16] = k[:, :, 2 * 16 : 3 * 16]
    # Make page 2's score the largest so the tie group sits at the top of the ranking.
    q = case.q.clone()
    q_mean_dir = page_centroids(k, case.seq_len)[:, :, 2]  # [B, Hkv, D]
    q += 16.0 * q_mean_dir.repeat_interleave(4, dim=1).to(q.dtype)
    paged = paged_from_contiguous(k, case.v, case.seq_len)
    tied = DecodeCase(q, k, case.v, case.seq_len, case.budget, paged)
    for top_k in (1, 2, 4, 6):
        check_selection(tied, (top_k + 3) * 16)
    page_idx, _ = select_pages_paged(q, paged.centroids, paged.block_table, paged.seq_len, 5 * 16)
    assert page_idx[:, :, :5].tolist() == [[[0, 2, 4, 10, 11]] * 2] * 2  # tie group {2, 4, 6, 7, 9} cut at 2
    # All-zero queries: every middle score is exactly 0, so the lowest middle pages win.
    zero_q = DecodeCase(torch.zeros_like(q), k, case.v, case.seq_len, case.budget, paged)
    check_selection(zero_q, 7 * 16)
    page_idx, _ = select_pages_paged(zero_q.q, paged.centroids, paged.block_table, paged.seq_len, 7 * 16)
    assert page_idx[0, 0, :7].tolist() == [0, 1, 2, 3, 4, 10, 11]


def test_radix_select_separates_scores_one_ulp_apart(device: torch.device) -> None:
    """Scores that differ only in their lowest mantissa bits (the radix select's last 10-bit pass),
    of both signs and around zero, are ranked exactly: the top 4 middle pages are the 4 largest."""
    seq_len = 16 * 12
    base = torch.tensor([1.0, -1.0, 0.0, -0.0, 3.0, 1.0, -2.0, 1.0, 0.5], dtype=torch.float32)
    scores = base.clone()
    scores[5] = torch.nextafter(scores[0], torch.tensor(2.0))  # 1.0 + 1 ulp
    scores[7] = torch.nextafter(scores[0], torch.tensor(0.0))  # 1.0 - 1 ulp
    # One KV head, D = 16: centroid = e_0 * score, q = e_0, so a page's score is exactly its value.
    k = torch.zeros(1, 1, seq_len, 16)
    for i, value in enumerate(scores.tolist()):
        k[0, 0, (i + 1) * 16 : (i + 2) * 16, 0] = value  # middle pages 1..9
    q = torch.zeros(1, 1, 16)
    q[0, 0, 0] = 1.0
    seq = torch.tensor([seq_len], dtype=torch.int32)
    case = DecodeCase(q.to(device), k.to(device), k.to(device), seq.to(device), seq.to(device),
                      paged_from_contiguous(k.to(device), k.to(device), seq.to(device)))  # fmt: skip
    check_selection(case, 7 * 16)
    page_idx, _ = select_pages_paged(case.q, case.paged.centroids, case.paged.block_table, case.paged.seq_len,
                                     7 * 16)  # fmt: skip
    # The four largest middle scores: 3.0 (page 5), 1 + ulp (page 6), 1.0 (page 1), 1 - ulp (page 8).
    assert page_idx[0, 0, :7].tolist() == [0, 1, 5, 6, 8, 10, 11]
    check_selection(case, 9 * 16)  # top 6: then 0.5, and 0.0 (page 3) before the tied -0.0 (page 4)
    page_idx, _ = select_pages_paged(case.q, case.paged.centroids, case.paged.block_table, case.paged.seq_len,
                                     9 * 16)  # fmt: skip
    assert page_idx[0, 0, :9].tolist() == [0, 1, 3, 5, 6, 8, 9, 10, 11]
