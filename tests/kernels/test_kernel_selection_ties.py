"""Property test of page selection on tie-heavy data (hypothesis), against the method layer.

Each page's keys are one of three integer templates, so the middle pages' scores take at most
three values per (sequence, KV head) and top-k cuts fall inside groups of equal scores. With
integer keys and queries every score is exact in float32 whatever the summation order
(centroids k/16, key bounds integers, group means q/G), so kernel and reference see the very same
ties and must break them the same way (lower page index first), under both page scores. The
partial last page is always a local page here.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DecodeCase, check_selection, paged_from_contiguous

hypothesis = pytest.importorskip("hypothesis")  # absent from some GPU images; CI has it
st = hypothesis.strategies


# The device fixture is stateless, so sharing it across examples is safe.
@hypothesis.settings(max_examples=24, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])  # fmt: skip
@hypothesis.given(
    seq_lens=st.lists(st.integers(1, 160), min_size=1, max_size=3),
    budget_pages=st.lists(st.integers(0, 12), min_size=3, max_size=3),
    group=st.sampled_from([1, 2, 4, 8]),
    sink_pages=st.integers(0, 2),
    local_pages=st.integers(1, 2),
    seed=st.integers(0, 2**16),
    page_score=st.sampled_from(["centroid", "minmax"]),
)
def test_selection_on_tied_integer_pages(
    device: torch.device,
    seq_lens: list[int],
    budget_pages: list[int],
    group: int,
    sink_pages: int,
    local_pages: int,
    seed: int,
    page_score: str,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, max_len, num_kv_heads = len(seq_lens), max(seq_lens), 2
    n_pages = (max_len + 15) // 16
    templates = torch.randint(-2, 3, (batch, num_kv_heads, 3, 16, 16), generator=gen).float()
    choice = torch.randint(0, 3, (batch, num_kv_heads, n_pages), generator=gen)
    k = torch.stack([templates[b, h, choice[b, h]] for b in range(batch) for h in range(num_kv_heads)])
    k = k.view(batch, num_kv_heads, n_pages * 16, 16)[:, :, :max_len].contiguous().to(device)
    v = torch.zeros_like(k)
    q = torch.randint(-2, 3, (batch, num_kv_heads * group, 16), generator=gen).float().to(device)
    seq_len = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    budget = torch.tensor(budget_pages[:batch], dtype=torch.int32, device=device) * 16
    case = DecodeCase(q, k, v, seq_len, budget, paged_from_contiguous(k, v, seq_len, seed=seed))
    check_selection(case, case.budget, page_score, sink_pages=sink_pages, local_pages=local_pages)
