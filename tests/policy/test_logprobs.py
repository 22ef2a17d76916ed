"""Single-rank vocab logprobs: padding columns excluded, input checks (the TP=2 case is in the multiproc suite)."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.policy.logprobs import vocab_parallel_logprobs


def test_single_rank_matches_log_softmax_and_ignores_padding_columns():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 24, generator=g, dtype=torch.float64).to(torch.bfloat16)
    logits[..., 20:] = 50.0  # padding rows of the output layer: huge, must not count
    targets = torch.randint(0, 20, (3, 5), generator=g)
    out = vocab_parallel_logprobs(logits, targets, vocab_size=20, top_k=25)
    ref = torch.log_softmax(logits[..., :20].float(), -1)
    torch.testing.assert_close(
        out.logprobs, ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(out.entropy, -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)
    assert out.topk_ids.shape == (3, 5, 20) and int(out.topk_ids.max()) < 20  # k capped at the real vocab
    torch.testing.assert_close(out.topk_logprobs, ref.sort(-1, descending=True).values, atol=1e-5, rtol=0)
    assert out.logprobs.dtype == torch.float32


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 20\)"):
        vocab_parallel_logprobs(torch.zeros(1, 2, 24), torch.tensor([[0, 20]]), vocab_size=20)
    with pytest.raises(ValueError, match=r"logits must be \[B, S, V\]"):
        vocab_parallel_logprobs(torch.zeros(2, 24), torch.zeros(2, dtype=torch.long), vocab_size=20)
    with pytest.raises(ValueError, match="exceeds"):
        vocab_parallel_logprobs(torch.zeros(1, 2, 8), torch.zeros(1, 2, dtype=torch.long), vocab_size=20)
