"""Sampling filters and per-sample seeding against brute-force definitions."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.sampling import (
    draw_uniforms,
    make_generators,
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


def test_per_sample_streams_are_independent_of_the_batch() -> None:
    seeds = [sample_seed(7, i) for i in range(4)]
    assert len(set(seeds)) == 4 and seeds == [sample_seed(7, i) for i in range(4)]
    assert sample_seed(8, 0) not in seeds
    batch_gens, alone_gens = make_generators(seeds), make_generators(seeds[2:3])
    together = torch.stack([draw_uniforms(batch_gens) for _ in range(3)])
    alone = torch.stack([draw_uniforms(alone_gens) for _ in range(3)])
    assert torch.equal(together[:, 2:3], alone)
    assert len(set(together[:, 2].tolist())) == 3  # a stream advances at every draw


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


def torch_draw(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """The draw written with torch.sort (fp64, stable) and the full filter mask: the definition the fast
    path must reproduce token for token."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1).double()
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(sorted_p.shape[-1])
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if params.top_k > 0:
        keep &= rank < params.top_k
    if params.top_p < 1.0:
        keep &= torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
    cdf = torch.cumsum(torch.where(keep, sorted_p, torch.zeros_like(sorted_p)), dim=-1)
    pick = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return order.gather(-1, torch.minimum(pick, keep.sum(dim=-1) - 1)[:, None]).squeeze(-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (1.0, 50, 0.5)]
)
def test_draws_equal_the_torch_sort_definition(temperature: float, top_k: int, top_p: float) -> None:
    """Same tokens as the torch.sort definition for the same uniforms, with tied and zero probabilities
    (masked and repeated logits) and uniforms at both ends."""
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for vocab in (128, 1000):
        logits = 3 * torch.randn(64, vocab, generator=gen)
        logits[:, ::7] = -float("inf")
        logits[:, 1] = logits[:, 2]
        uniforms = torch.rand(64, generator=gen, dtype=torch.float64)
        uniforms[0], uniforms[1] = 0.0, 1.0 - 2**-53
        assert torch.equal(sample_tokens(logits, params, uniforms), torch_draw(logits, params, uniforms))


def test_the_kernel_sort_is_torch_stable_descending_sort() -> None:
    """sort_rows_descending gives torch.sort(descending=True, stable=True)'s values and indices: ties in
    index order, zeros, negatives, infinities, a width that is not a power of two."""
    cpu_attention = pytest.importorskip("sparrow_nemo.rollout.torch.cpu_attention")
    if not cpu_attention.available():
        pytest.skip("no C compiler for the CPU kernel")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(33, 301, generator=gen)
    x[:, ::5] = 0.0
    x[:, 1::9] = x[:, 2::9][:, : x[:, 1::9].shape[1]]
    x[0, :4] = torch.tensor([float("inf"), -float("inf"), -0.5, 1e-30])
    x[1] = 0.25  # one value: every pass skipped
    values, order = cpu_attention.sort_rows_descending(x)
    expect = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(values, expect.values) and torch.equal(order, expect.indices)
