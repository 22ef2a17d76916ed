"""Launches per decoder layer of the engine's fused decode path (``KernelDecode``): at most 3.

Inside ``recorded_launches()`` the Triton launches are recorded (not run) while the host code runs
as usual; a torch dispatch mode logs every aten op the host code issues. Allocations and views
launch nothing; any other aten op (a cast, a clamp, a memset) is a device launch and is counted.
A sparse layer is append + select + attention; a dense layer append + attention (+ a counter
memset when it splits). A host read (``.item()``, ``int(t)``: aten ``_local_scalar_dense``) would
be logged too, so the sparse path is also shown to never synchronise.
"""

from __future__ import annotations

import pytest
import sparrow_kernels as sk
import torch
from kernel_cases import random_case
from sparrow_kernels import recorded_launches
from torch.utils._python_dispatch import TorchDispatchMode

from sparrow_nemo.rollout.torch.paged_attention import KernelDecode
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache

_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "unsqueeze", "select", "slice", "view", "as_strided",
              "alias", "detach", "expand", "_reshape_alias"}  # fmt: skip


class _AtenLog(TorchDispatchMode):
    """Names of the aten ops dispatched inside the block that launch device work."""

    def __init__(self) -> None:
        super().__init__()
        self.launching: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _NO_LAUNCH:
            self.launching.append(name)
        return func(*args, **(kwargs or {}))


def _layer_launches(
    budget: torch.Tensor | None, batch: int, page_score: str = "centroid"
) -> tuple[list[str], list[str]]:
    """(Triton kernels, launching aten ops) of one layer's append + attend, bf16 cache, int64 inputs."""
    hkv, d, ps = 8, 128, 16
    cache = PagedKVCache(1, 8, hkv, d, ps, dtype=torch.bfloat16, page_score=page_score)
    # 64 logical pages per row (1K tokens of capacity) over a small pool: nothing runs, nothing is read.
    block_table = (torch.arange(batch * 64, dtype=torch.int32) % 8).view(batch, 64)
    seq_len = torch.full((batch,), 50, dtype=torch.int64)
    positions = seq_len - 1  # the engine's own op, before the layers
    q = torch.zeros(batch, 32, d, dtype=torch.bfloat16)
    k_new = torch.zeros(batch, hkv, d, dtype=torch.bfloat16)
    fused = KernelDecode()
    log = _AtenLog()
    with recorded_launches() as launches, log:
        fused.append(cache, 0, block_table, positions, k_new, k_new)
        fused.attend(q, cache, 0, block_table, seq_len, budget, 1, 2)
    return [launch.kernel.__name__ for launch in launches], log.launching


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
@pytest.mark.parametrize("batch", [64, 2])  # 64 x 8 KV heads fills an H200: one split; 2 rows split
def test_sparse_layer_is_three_launches(batch: int, page_score: str) -> None:
    budget = torch.full((batch,), 32, dtype=torch.int64)  # the schedule's int64 budgets, not cast
    kernels, aten = _layer_launches(budget, batch, page_score)
    assert kernels == ["_append_kv_kernel", "_select_pages_kernel", "_paged_attention_kernel"]
    assert aten == [], f"host-side device ops on the sparse decode path: {aten}"


@pytest.mark.parametrize("batch", [64, 2])
def test_dense_layer_has_no_selection_launch(batch: int) -> None:
    kernels, aten = _layer_launches(None, batch)
    assert kernels == ["_append_kv_kernel", "_paged_attention_kernel"]
    assert len(kernels) + len(aten) <= 3 and set(aten) <= {"zeros", "zero_", "fill_"}, aten
    assert (aten != []) == (batch == 2)  # the split merge's counters are zeroed only when it splits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run by gpu_window.sh)")
def test_decode_layer_replays_from_a_cuda_graph() -> None:
    """append + select + attention (split, so the fused merge's tickets cycle) and the verify kernel,
    captured once and replayed for several steps with the inputs updated in place, equal eager calls."""
    case = random_case([300, 200], [96, 64], num_kv_heads=2, group=4, head_dim=128, dtype=torch.bfloat16,
                       device="cuda", seed=3, centroid_dtype=torch.bfloat16)  # fmt: skip
    c = case.paged
    seq_len = torch.tensor([250, 150], dtype=torch.int64, device="cuda")
    kv_new = torch.zeros(2, 2, 128, dtype=torch.bfloat16, device="cuda")
    q_verify = torch.randn(2, 3, 8, 128, dtype=torch.bfloat16, device="cuda")

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        sk.append_kv(c.k_pages, c.v_pages, c.centroids, c.block_table, seq_len - 1, kv_new, kv_new)
        sel = sk.page_selection(case.q, c.centroids, c.block_table, seq_len, case.budget)
        out = sk.decode_attention_paged(
            case.q, c.k_pages, c.v_pages, c.block_table, seq_len, sel, num_splits=3
        )
        return out, sk.verify_attention_paged(
            q_verify, c.k_pages, c.v_pages, c.block_table, seq_len, num_splits=2
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = step()
    for _ in range(3):
        seq_len += 1
        kv_new.normal_()
        graph.replay()
        eager = step()  # rewrites the same slot: identical state
        for got, want in zip(graphed, eager):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
