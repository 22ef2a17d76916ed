"""The speculative verify pass on the fused-kernel path (``sparrow_kernels.verify_attention_paged``).

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before ``sparrow_kernels`` is
first imported, as in test_kernel_path.py), at tiny shapes; on a GPU natively. Checked: the kernel verify
attention equals the torch one on a shuffled paged cache (rows at different lengths, GQA, T = k + 1 > 1), and
the engine's triton backend (fused draft steps, kernel verify, padded queries with pages reserved for them)
gives the torch backend's speculative tokens, which are dense greedy's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sparrow_kernels = pytest.importorskip("sparrow_kernels")
pytest.importorskip("triton")

from sparrow_nemo.rollout import SamplingParams, TorchRolloutEngine  # noqa: E402
from sparrow_nemo.rollout.torch.extend import KernelVerify, verify_attention_torch  # noqa: E402
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache  # noqa: E402
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig  # noqa: E402
from sparrow_nemo.sparse.schedule import BudgetSchedule  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _kernels_or_skip() -> None:
    if not sparrow_kernels.available(DEVICE):
        pytest.skip(f"sparrow_kernels cannot run on {DEVICE} (imported without TRITON_INTERPRET=1)")


@torch.no_grad()
def test_kernel_verify_attention_equals_the_torch_one() -> None:
    _kernels_or_skip()
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(1, 24, num_kv_heads=2, head_dim=16, page_size=4, device=DEVICE)
    for pool in (cache.k_pages[0], cache.v_pages[0]):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    order = torch.randperm(24, generator=gen).to(torch.int32)  # rows own scattered physical pages
    table = order.view(3, 8).to(DEVICE)
    start = torch.tensor([13, 2, 25], device=DEVICE)  # tokens cached before the T new ones
    q = torch.randn(3, 4, 8, 16, generator=gen).to(DEVICE)  # T = 4 queries, 8 query heads (group 4)
    got = KernelVerify().attend(q, cache, 0, table, start, torch.full_like(start, 4))
    want = verify_attention_torch(q, cache, 0, table, start)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.slow  # ~100 interpreted kernel launches per token on CPU
@torch.no_grad()
def test_triton_backend_speculates_as_the_torch_backend(hf_dir: Path) -> None:
    _kernels_or_skip()
    kw = {"dense_layers": 1, "dtype": torch.float32, "device": DEVICE, "page_size": 4}
    fused = TorchRolloutEngine.from_hf_dir(hf_dir, attention_backend="triton", **kw)
    plain = TorchRolloutEngine.from_hf_dir(hf_dir, attention_backend="torch", **kw)
    assert fused.backend == "triton" and plain.backend == "torch"
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, fused.shape.vocab_size, (n,), generator=gen).tolist() for n in (29, 7)]
    greedy = SamplingParams(max_new_tokens=7, temperature=0.0, stop_token_ids=())
    draft = BudgetSchedule(bin_tokens=16, budgets=(12,), page_size=4, name="t")
    spec = SpeculativeConfig(draft_tokens=(2, 3))  # rows at different k: the kernel sees padded queries
    dense = plain.generate(prompts, greedy, BudgetSchedule.dense(16, 4))
    for f, p, d in zip(
        fused.generate(prompts, greedy, draft, speculative=spec).samples,
        plain.generate(prompts, greedy, draft, speculative=spec).samples,
        dense.samples,
    ):
        assert torch.equal(f.response_ids, p.response_ids) and torch.equal(f.response_ids, d.response_ids)
        assert (f.logprobs - p.logprobs).abs().max() < 1e-4
        assert f.draft.verifies == p.draft.verifies
