"""Page scoring and selection kernels against the method layer (sparrow_nemo.sparse.attention).

Selection must match ``select_pages`` exactly (same pages, same order, -1 padding), including
the tie rule; scores must match GQA-mean query . centroid within 1e-5 (float32 sums of 16-64
products in a different order).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DecodeCase, check_selection, paged_from_contiguous, random_case
from sparrow_kernels import page_scores_paged, select_pages_paged

from sparrow_nemo.sparse.attention import page_centroids

# Mixed lengths in one batch: a partial last page (77 = 4 pages + 13 tokens), exact pages (160),
# a one-page sequence (5), and budgets below, at and above the length (with 3 reserved pages).
SEQ_LENS = [77, 160, 5, 123]
BUDGETS = [48, 96, 16, 2048]


@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])  # 5: Qwen3-14B (40 q heads, 8 KV heads)
def test_selection_matches_reference_for_gqa_ratios(device: torch.device, group: int) -> None:
    case = random_case(SEQ_LENS, BUDGETS, num_kv_heads=2, group=group, device=device, seed=group)
    check_selection(case, case.budget)


def test_selection_budget_edge_cases(device: torch.device) -> None:
    """Budget 0 and budgets below the reserved pages keep sink + local only; a budget equal to the
    page count keeps all; a huge int (the dense schedule) keeps everything."""
    case = random_case([200, 200, 200, 33], [0, 40, 208, 48], device=device, seed=7)
    check_selection(case, case.budget)
    check_selection(case, 2**40)  # an int covering the capacity: the no-scoring path
    dense_idx, dense_counts = select_pages_paged(case.q, case.paged.centroids, case.paged.block_table,
                                                 case.paged.seq_len, 2**40)  # fmt: skip
    kernel_idx, kernel_counts = select_pages_paged(case.q, case.paged.centroids, case.paged.block_table,
                                                   case.paged.seq_len, torch.full_like(case.budget, 2**30))  # fmt: skip
    assert torch.equal(dense_idx, kernel_idx) and torch.equal(dense_counts, kernel_counts)
    check_selection(case, 80, sink_pages=2, local_pages=1)
    check_selection(case, 64, sink_pages=0, local_pages=0)


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
    for top_k in (1, 2, 3, 4, 6):
        check_selection(tied, (top_k + 3) * 16)
    page_idx, _ = select_pages_paged(q, paged.centroids, paged.block_table, paged.seq_len, 5 * 16)
    assert page_idx[:, :, :5].tolist() == [[[0, 2, 4, 10, 11]] * 2] * 2  # tie group {2, 4, 6, 7, 9} cut at 2
    # All-zero queries: every middle score is exactly 0, so the lowest middle pages win.
    zero_q = DecodeCase(torch.zeros_like(q), k, case.v, case.seq_len, case.budget, paged)
    check_selection(zero_q, 7 * 16)
    page_idx, _ = select_pages_paged(zero_q.q, paged.centroids, paged.block_table, paged.seq_len, 7 * 16)
    assert page_idx[0, 0, :7].tolist() == [0, 1, 2, 3, 4, 10, 11]


def test_scores_match_gqa_mean_dot_centroid(device: torch.device) -> None:
    case = random_case(SEQ_LENS, BUDGETS, num_kv_heads=2, group=4, device=device, seed=11)
    c = case.paged
    scores = page_scores_paged(case.q, c.centroids, c.block_table, c.seq_len)
    batch, num_q_heads, head_dim = case.q.shape
    q_mean = case.q.float().view(batch, 2, num_q_heads // 2, head_dim).mean(dim=2)
    expected = torch.einsum("bhd,bhpd->bhp", q_mean, page_centroids(case.k, case.seq_len))
    n_pages = (case.seq_len + 15) // 16
    live = torch.arange(scores.shape[-1], device=device)[None, :] < n_pages[:, None]  # [B, P]
    live = live[:, None, :].expand_as(scores)
    torch.testing.assert_close(scores[live], expected[live], rtol=1e-5, atol=1e-5)
    assert bool(torch.isneginf(scores[~live]).all())
