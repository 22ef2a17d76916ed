"""TensorRT-LLM's KV pool through the layout adapter and ``sparrow_kernels`` equals the method layer.

The pool is built and written the way TensorRT-LLM's C++ manager and attention kernels lay it out and
address it (``trtllm_pool.TrtllmPool``, independent of the adapter). The adapter's page views and block
table must read exactly that; the Hopper generation step (``sparse_decode_step``: append into the pool,
select, attend) run by the kernels under ``TRITON_INTERPRET=1`` must equal the method layer's
``sparse_decode_attention`` on the same keys and values under both page scores (centroid, minmax), and write the new token where TensorRT-LLM's
kernels will read it; the SM100 index path must produce TensorRT-LLM's index layout of the same pages.
The whole per-step path must read no tensor value on the host (CUDA-graph capturable).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sparrow_kernels = pytest.importorskip("sparrow_kernels")
pytest.importorskip("triton")

from sparrow_nemo.rollout.trtllm.decode import (  # noqa: E402
    BudgetTable,
    generation_path,
    predict_native_indices,
    sparse_decode_step,
    to_trtllm_indices,
)
from sparrow_nemo.rollout.trtllm.kv_cache import LandmarkPool, context_token_positions  # noqa: E402
from sparrow_nemo.rollout.trtllm.layout import block_table_from_offsets, kv_page_views  # noqa: E402
from sparrow_nemo.sparse.attention import select_pages, sparse_decode_attention  # noqa: E402
from sparrow_nemo.sparse.schedule import BudgetSchedule  # noqa: E402

from .trtllm_pool import TrtllmPool  # noqa: E402
from .trtllm_sync_guard import HostRead, no_host_reads  # noqa: E402

DEVICE = torch.device("cpu")
PS, HKV, HQ, D, LAYERS, LAYER = 4, 2, 4, 16, 3, 1
PROMPTS = [9, 22, 13]
STEPS = 5
SCHEDULE = BudgetSchedule(bin_tokens=12, budgets=(16, 24), page_size=PS, name="t")

pytestmark = pytest.mark.skipif(
    not sparrow_kernels.available(DEVICE),
    reason="sparrow_kernels cannot run on CPU (needs TRITON_INTERPRET=1)",
)


class Case:
    """Prompts written into a TensorRT-LLM-shaped pool, with the reference keys/values beside it."""

    def __init__(
        self, seed: int = 0, dtype: torch.dtype = torch.float32, page_score: str = "centroid"
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.max_len = max(PROMPTS) + STEPS
        self.max_blocks = math.ceil(self.max_len / PS)
        num_blocks = len(PROMPTS) * self.max_blocks + 5
        perm = torch.randperm(num_blocks, generator=gen).tolist()  # blocks handed out shuffled
        self.tables = [perm[i * self.max_blocks : (i + 1) * self.max_blocks] for i in range(len(PROMPTS))]
        self.pool = TrtllmPool(num_blocks, LAYERS, HKV, PS, D, dtype)
        self.offsets = self.pool.block_offsets(self.tables, self.max_blocks)
        self.keys = torch.randn(len(PROMPTS), self.max_len, HKV, D, generator=gen).to(dtype)
        self.values = torch.randn(len(PROMPTS), self.max_len, HKV, D, generator=gen).to(dtype)
        self.q = torch.randn(STEPS, len(PROMPTS), HQ, D, generator=gen).to(dtype)
        for row, n in enumerate(PROMPTS):
            for t in range(n):
                self.pool.write(LAYER, self.offsets, row, t, self.keys[row, t], self.values[row, t])
        self.landmarks = LandmarkPool(num_blocks, [LAYER], HKV, D, PS, kv_dtype=dtype, page_score=page_score)
        self.budget_table = BudgetTable(SCHEDULE, self.max_len, DEVICE)

    def table(self) -> torch.Tensor:
        return block_table_from_offsets(self.offsets, 0, 0, len(PROMPTS), LAYERS)

    def prefill_landmarks(self) -> None:
        """The context phase's landmark write, from the packed prompt keys as TensorRT-LLM hands them."""
        packed = torch.cat([self.keys[row, :n] for row, n in enumerate(PROMPTS)])
        rows, positions = context_token_positions(torch.tensor(PROMPTS, dtype=torch.int32), packed.shape[0])
        self.landmarks.write_prefill(LAYER, packed, rows, positions, self.table())

    def contiguous(self, seq_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's [B, Hkv, L, D] keys and values (positions past seq_len zero)."""
        length = int(seq_len.max())
        k = self.keys[:, :length].transpose(1, 2).clone()
        v = self.values[:, :length].transpose(1, 2).clone()
        for row, n in enumerate(seq_len.tolist()):
            k[row, :, n:] = 0
            v[row, :, n:] = 0
        return k, v

    def fused_qkv(self, step: int, positions: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(len(PROMPTS))
        k, v = self.keys[rows, positions], self.values[rows, positions]
        return torch.cat([self.q[step].flatten(1), k.flatten(1), v.flatten(1)], dim=1)


def test_views_and_block_table_read_what_trtllm_wrote() -> None:
    case = Case()
    table = case.table()
    assert table.dtype == torch.int32 and table.shape == (len(PROMPTS), case.max_blocks)
    assert table.tolist() == case.tables
    assert block_table_from_offsets(case.offsets, 0, 1, 2, LAYERS).tolist() == case.tables[1:]
    k_pages, v_pages = kv_page_views(case.pool.get_buffers_hnd(LAYER))
    assert k_pages.shape == (case.pool.shape[0], HKV, PS, D) and k_pages.stride(-1) == 1
    for row, n in enumerate(PROMPTS):
        for t in range(n):
            block, slot = table[row, t // PS], t % PS
            assert torch.equal(k_pages[block, :, slot], case.keys[row, t])
            assert torch.equal(v_pages[block, :, slot], case.values[row, t])
    other_k, other_v = kv_page_views(case.pool.get_buffers_hnd(0))
    assert not other_k.any() and not other_v.any()  # the views do not reach into another layer
    with pytest.raises(ValueError, match="HND view"):
        kv_page_views(case.pool.get_buffers_hnd(LAYER)[:, 0])  # K alone: no K/V pair
    with pytest.raises(ValueError, match="kv_cache_block_offsets"):
        block_table_from_offsets(case.offsets[0], 0, 0, 1, LAYERS)


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
def test_hopper_decode_step_over_the_trtllm_pool_equals_the_method_layer(page_score: str) -> None:
    case = Case(page_score=page_score)
    case.prefill_landmarks()
    table = case.table()
    layer_pool = case.pool.get_buffers_hnd(LAYER)
    lengths = torch.tensor(PROMPTS)
    sparse_rows = 0
    for step in range(STEPS):
        seq_len = (lengths + 1).to(torch.int32)
        budgets = case.budget_table.budgets(seq_len)
        assert torch.equal(budgets.long(), SCHEDULE.budgets_for(seq_len.long()))
        out = sparse_decode_step(
            case.fused_qkv(step, lengths),
            layer_pool,
            case.landmarks.layer(LAYER),
            table,
            seq_len,
            budgets,
            num_heads=HQ,
            sink_pages=1,
            local_pages=2,
            scale=1 / math.sqrt(D),
        )
        for row, pos in enumerate(lengths.tolist()):  # the new token is where TensorRT-LLM's kernels read it
            k_read, v_read = case.pool.read(LAYER, case.offsets, row, pos)
            assert torch.equal(k_read, case.keys[row, pos]) and torch.equal(v_read, case.values[row, pos])
        k_ref, v_ref = case.contiguous(seq_len)
        expected = sparse_decode_attention(case.q[step], k_ref, v_ref, seq_len, budgets, PS, 1, 2, page_score)
        torch.testing.assert_close(out.view(-1, HQ, D), expected, rtol=1e-5, atol=1e-5)
        sparse_rows += int(((seq_len + PS - 1) // PS > budgets // PS).sum())
        lengths = lengths + 1
    assert sparse_rows > 0  # the budgets dropped pages: the comparison covered real selection


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
def test_sm100_indices_are_trtllm_layout_of_the_method_layer_pages(page_score: str) -> None:
    case = Case(seed=1, page_score=page_score)
    case.prefill_landmarks()
    table = case.table()
    lengths = torch.tensor(PROMPTS)
    seq_len = (lengths + 1).to(torch.int32)
    rows = torch.arange(len(PROMPTS))
    q, k = case.q[0], case.keys[rows, lengths]
    for row, pos in enumerate(lengths.tolist()):  # on this path TensorRT-LLM's op writes the new K/V
        case.pool.write(LAYER, case.offsets, row, pos, case.keys[row, pos], case.values[row, pos])
    budgets = case.budget_table.budgets(seq_len)
    indices, offsets = predict_native_indices(
        q, k, case.landmarks, LAYER, table, seq_len, budgets, sink_pages=1, local_pages=2
    )
    k_ref, _ = case.contiguous(seq_len)
    expected = select_pages(q, k_ref, seq_len, budgets, PS, 1, 2, page_score)
    assert indices.is_contiguous() and indices.shape == (HKV, len(PROMPTS) * table.shape[1] + 1)
    stride, flat = indices.shape[-1], indices.view(-1)
    for b in range(len(PROMPTS)):
        start, end = int(offsets[b]), int(offsets[b + 1])
        for h in range(HKV):  # gatherKvPageOffsets: head * stride + offsets[b] + i
            kept = expected[b, h][expected[b, h] >= 0]
            assert flat[h * stride + start : h * stride + end].tolist() == kept.tolist()
    page_idx, counts = sparrow_kernels.select_pages_paged(
        q, case.landmarks.layer(LAYER), table, seq_len, budgets, PS
    )
    again, again_offsets = to_trtllm_indices(page_idx, counts)
    assert torch.equal(again, indices) and torch.equal(again_offsets, offsets)


def test_generation_path_follows_trtllm_gen_gating() -> None:
    assert generation_path(90) == "sparrow_kernels"  # H100 / H200: XQA ignores the indices
    assert generation_path(89) == generation_path(80) == "sparrow_kernels"
    assert generation_path(100) == generation_path(103) == "native"  # B200 / B300: TRTLLM-GEN
    assert generation_path(120) == generation_path(121) == "sparrow_kernels"  # consumer Blackwell


def test_budget_table_updates_in_place() -> None:
    table = BudgetTable(SCHEDULE, max_seq_len=40, device=DEVICE)
    storage = table.table.data_ptr()
    wider = BudgetSchedule(bin_tokens=12, budgets=(16, 32, 40), page_size=PS, name="w")
    table.update(wider)
    assert table.table.data_ptr() == storage  # a captured graph keeps reading the same tensor
    lengths = torch.arange(0, 60, 5)
    assert torch.equal(table.budgets(lengths).long(), wider.budgets_for(lengths))
    with pytest.raises(ValueError, match="bin_tokens=10"):
        table.update(BudgetSchedule(bin_tokens=10, budgets=(16,), page_size=PS))


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
def test_the_step_reads_no_tensor_on_the_host(page_score: str) -> None:
    case = Case(seed=2, page_score=page_score)
    lengths = torch.tensor(PROMPTS)
    seq_len = (lengths + 1).to(torch.int32)
    packed = torch.cat([case.keys[row, :n] for row, n in enumerate(PROMPTS)])
    prompt_lens = torch.tensor(PROMPTS, dtype=torch.int32)
    rows = torch.arange(len(PROMPTS))
    with no_host_reads():
        table = block_table_from_offsets(case.offsets, 0, 0, len(PROMPTS), LAYERS)
        token_rows, positions = context_token_positions(prompt_lens, packed.shape[0])
        case.landmarks.write_prefill(LAYER, packed, token_rows, positions, table)
        budgets = case.budget_table.budgets(seq_len)
        sparse_decode_step(
            case.fused_qkv(0, lengths),
            case.pool.get_buffers_hnd(LAYER),
            case.landmarks.layer(LAYER),
            table,
            seq_len,
            budgets,
            num_heads=HQ,
            sink_pages=1,
            local_pages=2,
            scale=1 / math.sqrt(D),
        )
        predict_native_indices(
            case.q[1], case.keys[rows, lengths + 1], case.landmarks, LAYER, table, seq_len + 1, budgets,
            sink_pages=1, local_pages=2,
        )  # fmt: skip
    with no_host_reads(), pytest.raises(HostRead, match=r"sparrow_nemo\.sparse\.schedule called Tensor"):
        SCHEDULE.budgets_for(seq_len.long())  # the guard does catch a host read (this one checks min())
