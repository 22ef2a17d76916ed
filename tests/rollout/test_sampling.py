"""Sampling filters and per-sample seeding against brute-force definitions."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.sampling import (
    ACCEPT,
    CDF_BLOCK,
    DRAFT,
    TOKEN,
    kept_probs,
    position_uniforms,
    sample_from,
    sample_seed,
    sample_tokens,
    token_logprobs,
)

N = 40_000  # draws: frequency standard error <= 0.0025, tolerance 0.012 is ~5 sigma


def kept_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Brute force: sort, keep top_k, keep while the mass before a token is < top_p, renormalise."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    out = torch.zeros_like(probs)
    mass = 0.0
    for rank, i in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        out[i] = probs[i]
        mass += float(probs[i])
    return out / out.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (1.0, 4, 0.5)]
)
def test_empirical_frequencies_match_the_filtered_distribution(
    temperature: float, top_k: int, top_p: float
) -> None:
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = sample_tokens(logits.expand(N, -1), params, torch.rand(N, dtype=torch.float64))
    freq = torch.bincount(tokens, minlength=12).double() / N
    want = kept_distribution(logits, temperature, top_k, top_p)
    assert torch.all(freq[want == 0] == 0)
    assert (freq - want).abs().max() < 0.012


def test_greedy_and_logprobs() -> None:
    logits = torch.randn(3, 50)
    assert torch.equal(
        sample_tokens(logits, SamplingParams(temperature=0.0), torch.zeros(3)), logits.argmax(-1)
    )
    tokens = torch.tensor([4, 0, 49])
    lp, ids, top = token_logprobs(logits, tokens, 20)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, ref[torch.arange(3), tokens])
    assert torch.equal(ids, ref.topk(20, -1).indices) and torch.allclose(top, ref.topk(20, -1).values)
    assert token_logprobs(logits[:, :7], tokens.clamp(max=6), 20)[1].shape == (3, 7)


def test_position_uniforms_depend_only_on_seed_position_and_stream() -> None:
    seeds = [sample_seed(7, i) for i in range(4)]
    assert len(set(seeds)) == 4 and seeds == [sample_seed(7, i) for i in range(4)]
    assert sample_seed(8, 0) not in seeds
    together = position_uniforms(seeds, [0, 5, 9, 2], TOKEN)
    alone = position_uniforms(seeds[2:3], [9], TOKEN)
    assert together.dtype == torch.float64 and torch.equal(together[2:3], alone)  # no batch mate matters
    draws = {
        float(position_uniforms([seeds[0]], [t], stream)[0])
        for t in range(50)
        for stream in (TOKEN, DRAFT, ACCEPT)
    }
    assert len(draws) == 150  # every (position, stream) has its own draw
    many = position_uniforms([seeds[1]] * 200_000, range(200_000), TOKEN)
    assert float(many.min()) >= 0.0 and float(many.max()) < 1.0
    counts = torch.histc(many, bins=20, min=0.0, max=1.0)  # 10,000 expected per bin, sd 97
    assert (counts - 10_000).abs().max() < 600
    assert abs(float(many[:-1].mul(many[1:]).mean()) - 0.25) < 0.005  # successive positions uncorrelated


def test_bad_sampling_params_name_the_field() -> None:
    for kwargs, field in [
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"stop_strings": ("",)}, "stop_strings"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def flat_draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The definition: the first id whose fp64 cumulative weight, in vocabulary order, exceeds u * total."""
    cdf = torch.cumsum(weights.double(), dim=-1)
    return torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (1.0, 50, 0.5)]
)
def test_draws_equal_the_flat_inverse_cdf_over_the_kept_set(
    temperature: float, top_k: int, top_p: float
) -> None:
    """Same tokens as one fp64 cumulative sum over the whole vocabulary, for vocabularies of less than one
    block, several blocks and a ragged last block, with tied and zero probabilities and uniforms at both ends;
    the kept set is the brute-force one."""
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for vocab in (128, 3 * CDF_BLOCK, 5000):
        logits = 3 * torch.randn(64, vocab, generator=gen)
        logits[:, ::7] = -float("inf")
        logits[:, 1] = logits[:, 2]
        uniforms = torch.rand(64, generator=gen, dtype=torch.float64)
        uniforms[0], uniforms[1] = 0.0, 1.0 - 2**-53
        kept = kept_probs(logits, params)
        assert torch.equal(sample_tokens(logits, params, uniforms), flat_draw(kept, uniforms))
        for row in (0, 5):
            want = kept_distribution(logits[row], temperature, top_k, top_p)
            assert torch.equal(kept[row] > 0, want > 0)


def test_a_draw_never_lands_on_a_zero_weight_id() -> None:
    """Weight only in the last id of the first block and the first of the last: u close to 1 lands on the
    latter even when u * total rounds up to the total."""
    w = torch.zeros(4, 4 * CDF_BLOCK, dtype=torch.float64)
    w[:, CDF_BLOCK - 1] = 1e-300
    w[:, -CDF_BLOCK] = 1.0
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-53, 1.0 - 2**-52], dtype=torch.float64)
    assert sample_from(w, u).tolist() == [CDF_BLOCK - 1] + [3 * CDF_BLOCK] * 3


def test_no_sort_without_top_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain sampling and top-k never sort the vocabulary (top-p alone ranks it)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the sampler sorted the vocabulary")

    logits = torch.randn(8, 3000)
    u = torch.rand(8, dtype=torch.float64)
    monkeypatch.setattr(torch, "sort", refuse)
    sample_tokens(logits, SamplingParams(), u)
    sample_tokens(logits, SamplingParams(top_k=50), u)
    with pytest.raises(AssertionError, match="sorted"):
        sample_tokens(logits, SamplingParams(top_p=0.9), u)
