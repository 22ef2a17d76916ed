"""Rollouts -> padded policy tensors and per-token mismatch, against per-token loops (exact, float32)."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.grpo.rollout_step import collate, pad_pairs, token_mismatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.packing import concat_outputs, micro_batches
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.sparse.mismatch import acceptance_rate_topk

V, K = 12, 4


def _topk(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(torch.randn(n, V, generator=gen), -1)
    vals, ids = logp.topk(K, dim=-1)
    return ids, vals


def _sample(gen: torch.Generator, prompt_len: int, resp_len: int) -> RolloutSample:
    ids, vals = _topk(gen, resp_len)
    return RolloutSample(
        prompt_ids=torch.randint(3, V, (prompt_len,), generator=gen),
        response_ids=torch.randint(3, V, (resp_len,), generator=gen),
        logprobs=-torch.rand(resp_len, generator=gen),
        top_ids=ids,
        top_logprobs=vals,
        cached_len=torch.arange(prompt_len, prompt_len + resp_len),
        kv_budget=torch.full((resp_len,), 64),
        finish_reason="stop_token",
    )


@pytest.fixture
def samples() -> list[RolloutSample]:
    gen = torch.Generator().manual_seed(0)
    return [_sample(gen, 5, 3), _sample(gen, 2, 6), _sample(gen, 4, 1)]


def test_collate_places_each_response_token_where_the_policy_scores_it(samples) -> None:
    adv = torch.tensor([0.5, -1.0, 2.0])
    data = collate(samples, adv, pad_id=0)
    assert data.tokens.shape == (3, 8) and data.response_mask.shape == (3, 7)
    assert data.lengths.tolist() == [8, 8, 5]
    for i, s in enumerate(samples):
        lp, lr = s.prompt_ids.numel(), s.response_ids.numel()
        cols = data.response_mask[i].nonzero().flatten().tolist()
        assert cols == list(range(lp - 1, lp - 1 + lr))
        # column j scores token j + 1: the response tokens themselves
        assert torch.equal(data.tokens[i, [c + 1 for c in cols]], s.response_ids)
        assert torch.equal(data.rollout_logprobs[i, cols], s.logprobs)
        assert int(data.tokens[i, lp + lr :].abs().sum()) == 0
    assert torch.equal(data.advantages, adv)


def test_pad_pairs_and_micro_batches_split_rows_and_extras() -> None:
    tokens, lengths, mask = pad_pairs(
        [torch.tensor([1, 2]), torch.tensor([1])], [torch.tensor([7]), torch.tensor([8, 9])]
    )
    assert tokens.tolist() == [[1, 2, 7], [1, 8, 9]]
    assert mask.tolist() == [[False, True], [True, True]]
    extra = torch.arange(2.0)
    batches = micro_batches(tokens, lengths, {"x": extra}, 1)
    assert [b.extras["x"].item() for b in batches] == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"not a multiple of policy\.micro_batch_size=3"):
        micro_batches(tokens, lengths, {}, 3)


def test_token_mismatch_equals_a_per_token_loop(samples) -> None:
    data = collate(samples, torch.zeros(3))
    gen = torch.Generator().manual_seed(1)
    n, width = data.response_mask.shape
    ids, vals = _topk(gen, n * width)
    dense = LogprobOutput(
        logprobs=-torch.rand(n, width, generator=gen),
        entropy=torch.rand(n, width, generator=gen),
        topk_ids=ids.view(n, width, K),
        topk_logprobs=vals.view(n, width, K),
    )
    got = token_mismatch(samples, dense, data)
    alpha, cached, train = [], [], []
    for i, s in enumerate(samples):
        lp = s.prompt_ids.numel()
        for t in range(s.response_ids.numel()):
            col = lp - 1 + t
            alpha.append(
                acceptance_rate_topk(
                    dense.topk_ids[i, col], dense.topk_logprobs[i, col], s.top_ids[t], s.top_logprobs[t]
                )
            )
            cached.append(int(s.cached_len[t]))
            train.append(float(dense.logprobs[i, col]))
    torch.testing.assert_close(got.alpha, torch.stack(alpha).float(), rtol=0, atol=1e-6)
    assert got.cached_len.tolist() == cached
    torch.testing.assert_close(got.train_logprobs, torch.tensor(train))
    torch.testing.assert_close(got.gen_logprobs, torch.cat([s.logprobs for s in samples]))


def test_concat_outputs_stacks_micro_batches() -> None:
    parts = [
        LogprobOutput(
            torch.full((1, 3), float(i)),
            torch.zeros(1, 3),
            torch.zeros(1, 3, 2, dtype=torch.long),
            torch.zeros(1, 3, 2),
        )
        for i in range(2)
    ]
    out = concat_outputs(parts)
    assert out.logprobs.tolist() == [[0.0] * 3, [1.0] * 3] and out.topk_ids.shape == (2, 3, 2)
