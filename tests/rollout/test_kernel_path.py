"""The engine's fused-kernel decode path (sparrow_kernels) equals its torch path.

On CPU the kernels run under Triton's interpreter, which must be switched on before
``sparrow_kernels`` is first imported (as tests/kernels/conftest.py does); on a GPU they run natively.
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
from sparrow_nemo.sparse.schedule import BudgetSchedule  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
def test_triton_backend_matches_torch_backend(hf_dir: Path, page_score: str) -> None:
    """Both page scores; kernels without key bounds (no ``sparrow_kernels.KeyBounds``) refuse minmax at once."""
    if not sparrow_kernels.available(DEVICE):
        pytest.skip(f"sparrow_kernels cannot run on {DEVICE} (imported without TRITON_INTERPRET=1)")
    kw = {"dense_layers": 1, "dtype": torch.float32, "device": DEVICE, "page_score": page_score}
    if page_score == "minmax" and not hasattr(sparrow_kernels, "KeyBounds"):
        with pytest.raises(ValueError, match=r"page_score='minmax' on the triton backend needs .*KeyBounds"):
            TorchRolloutEngine.from_hf_dir(hf_dir, attention_backend="triton", **kw)
        return
    fused = TorchRolloutEngine.from_hf_dir(hf_dir, attention_backend="triton", **kw)
    plain = TorchRolloutEngine.from_hf_dir(hf_dir, attention_backend="torch", **kw)
    assert fused.backend == "triton" and plain.backend == "torch"
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, fused.shape.vocab_size, (n,), generator=gen).tolist() for n in (45, 7)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=())
    schedule = BudgetSchedule(bin_tokens=48, budgets=(32, 48), name="t")
    for a, b in zip(
        fused.generate(prompts, params, schedule).samples, plain.generate(prompts, params, schedule).samples
    ):
        assert torch.equal(a.response_ids, b.response_ids)
        assert (a.logprobs - b.logprobs).abs().max() < 1e-4
