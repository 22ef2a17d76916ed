"""Speculative rollout (sparse draft, dense verify) in the torch engine: exactness against dense decoding.

- the acceptance rule as pure functions: its sampler is ``sample_tokens``' draw, and draft / accept / resample
  give exactly the dense distribution (checked by exhaustive enumeration of a tiny vocabulary);
- greedy speculative output equals dense greedy token for token (160 tokens here, 1,100 on a random and on
  the warm-started smoke-recipe model in the slow tests), for several draft lengths (per bin), a budget that
  forces rejections, stops in the middle of accepted runs (stop tokens and stop strings; every page freed
  once) and a LoRA adapter on the draft only;
- returned logprobs and top-K equal ``engine.score()`` of the same sequences (dense), and the recorded
  cached lengths and budgets follow the engine's conventions;
- per-sample draws: a sample gives the same tokens alone and inside a batch, and k = 0 equals dense sampling;
- the cache after a round equals a cache that never saw the rejected tokens (keys, values, and the page
  landmarks of either page score: centroids, or the minmax key bounds); with the minmax score drafting,
  greedy speculative output still equals dense greedy.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sparrow_nemo.hf_qwen3 import LoraAdapter, linear_in_out
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.sampling import (
    ACCEPT,
    TOKEN,
    kept_probs,
    position_uniforms,
    sample_from,
    sample_seed,
    sample_tokens,
    sampling_probs,
)
from sparrow_nemo.rollout.sampling import (
    DRAFT as DRAFT_STREAM,
)
from sparrow_nemo.rollout.torch.block_manager import BlockManager
from sparrow_nemo.rollout.torch.decode_step import DecodeStep
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.extend import TorchVerify, forward_tokens, rebuild_landmarks
from sparrow_nemo.rollout.torch.paged_attention import TorchDecode
from sparrow_nemo.rollout.torch.paged_cache import PagedKVCache, fill_block_table
from sparrow_nemo.rollout.torch.sequence import Sequence as Seq
from sparrow_nemo.rollout.torch.spec_decode import SpeculativeRounds, SpeculativeSample
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig, verify_drafts
from sparrow_nemo.rollout.torch.stopping import StopRule
from sparrow_nemo.sparse.attention import page_key_bounds
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

#: 3 layers (1 dense), 4-token pages, long enough positions for 1K+ token responses
SHAPE = PRESETS["tiny-test"].replace(num_layers=3, max_position_embeddings=2048)
PAGE = 4
DENSE = BudgetSchedule.dense(16, PAGE)
#: 2 top-k pages + sink + 2 local: far below the contexts here, so drafts are often rejected
DRAFT = BudgetSchedule(bin_tokens=16, budgets=(20,), page_size=PAGE, name="draft20")


def make_engine(seed: int = 0, **kw) -> TorchRolloutEngine:
    return TorchRolloutEngine.from_shape(
        SHAPE, seed=seed, dense_layers=1, page_size=PAGE, attention_backend="torch", **kw
    )


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SHAPE.vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def engine() -> TorchRolloutEngine:
    return make_engine()


# ----------------------------------------------------------------------------- the rule, pure functions
@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=7, top_p=0.6),
    ],
)
def test_the_sampler_is_sample_tokens_draw_and_probs_are_its_distribution(sampling: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4000, 11, generator=gen) * 2
    u = torch.rand(4000, generator=gen, dtype=torch.float64)
    assert torch.equal(sample_from(kept_probs(logits, sampling), u), sample_tokens(logits, sampling, u))
    probs = sampling_probs(logits, sampling)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4000, dtype=torch.float64))
    # the kept set is what sample_tokens can return: every draw has positive probability
    assert bool((probs.gather(1, sample_tokens(logits, sampling, u)[:, None]) > 0).all())


def _enumerated_first_token(p_logits, q_logits, sampling, grid: int) -> torch.Tensor:
    """Distribution of the first emitted token of a 1-draft round, by enumerating the draft token (weighted
    by q) and a uniform grid of acceptance / final draws: [V] float64."""
    vocab = p_logits.shape[-1]
    q = sampling_probs(q_logits, sampling)
    drafts, ia, jf = (
        t.reshape(-1)
        for t in torch.meshgrid(torch.arange(vocab), torch.arange(grid), torch.arange(grid), indexing="ij")
    )
    ua, uf = (ia.double() + 0.5) / grid, (jf.double() + 0.5) / grid
    n = drafts.numel()
    verdict = verify_drafts(
        torch.stack([p_logits, p_logits], 0)[None].expand(n, 2, vocab),
        q_logits[None, None].expand(n, 1, vocab),
        drafts[:, None],
        torch.ones(n, dtype=torch.int64),
        sampling,
        ua[:, None],
        uf[:, None].expand(-1, 2),
    )
    first = torch.where(verdict.accepted > 0, drafts, verdict.next_token)
    weight = q[drafts] / grid**2
    return torch.zeros(vocab, dtype=torch.float64).index_add_(0, first, weight)


@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4, top_p=0.9)]
)
def test_draft_accept_resample_gives_the_dense_distribution_exactly(sampling: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(6, generator=gen) * 1.5, torch.randn(6, generator=gen) * 1.5
    got = _enumerated_first_token(p_logits, q_logits, sampling, grid=400)
    want = sampling_probs(p_logits, sampling)
    # grid quadrature of the two uniforms: exact up to O(1/grid) at the min(1, p/q) and residual CDF steps
    torch.testing.assert_close(got, want, atol=4e-3, rtol=0)
    q = sampling_probs(q_logits, sampling)
    assert float((q - want).abs().sum()) > 0.5  # the draft really differs: the rule has work to do


def test_greedy_rule_accepts_while_the_draft_is_the_dense_argmax() -> None:
    vocab = 5
    target = torch.tensor([[1, 3, 0, 4], [2, 2, 2, 2], [4, 1, 1, 0]])  # dense argmax after each fed token
    dense = torch.nn.functional.one_hot(target, vocab).float() * 5
    drafts = torch.tensor([[1, 3, 2], [2, 2, 2], [0, 1, 1]])
    draft_logits = torch.nn.functional.one_hot(drafts, vocab).float() * 5
    greedy = SamplingParams(temperature=0.0)
    zeros = torch.zeros(3, 3, dtype=torch.float64)
    v = verify_drafts(dense, draft_logits, drafts, torch.tensor([3, 3, 2]), greedy, zeros, torch.zeros(3, 4))
    assert v.accepted.tolist() == [2, 3, 0]
    assert v.next_token.tolist() == [0, 2, 4]  # the dense argmax at the first mismatch, or the bonus
    assert v.tested.tolist() == [[True, True, True], [True, True, True], [True, False, False]]


def test_a_round_draws_by_position(engine: TorchRolloutEngine) -> None:
    """A row's draft, acceptance and emitted-token draws are those of its seed at its response positions (the
    emitted token's stream is plain decoding's), zero past its k, and all zero when greedy."""
    rounds = SpeculativeRounds(
        engine.model, None, None, SamplingParams(), DRAFT, SpeculativeConfig(), StopRule(frozenset()), False
    )
    seqs = [Seq(0, 0, 5, 100, seed=11, response=[1] * 4), Seq(1, 0, 5, 100, seed=12, response=[1] * 9)]
    ks = [3, 0]
    draft, accept, final = rounds._uniforms(seqs, ks, 3)
    for b, (seq, k) in enumerate(zip(seqs, ks)):
        pos = [seq.num_generated + j for j in range(4)]
        assert draft[b, :k].tolist() == position_uniforms([seq.seed] * k, pos[:k], DRAFT_STREAM).tolist()
        assert accept[b, :k].tolist() == position_uniforms([seq.seed] * k, pos[:k], ACCEPT).tolist()
        assert final[b].tolist() == position_uniforms([seq.seed] * 4, pos, TOKEN).tolist()
        assert not draft[b, k:].any() and not accept[b, k:].any()
    rounds.sampling = SamplingParams(temperature=0.0)
    assert all(not t.any() for t in rounds._uniforms(seqs, ks, 3))


def test_config_k_per_bin_and_round_trip() -> None:
    spec = SpeculativeConfig(draft_tokens=(0, 3, 5), draft_schedule=DRAFT)
    assert spec.k_for(torch.tensor([0, 15, 16, 40, 10_000]), 16).tolist() == [0, 0, 3, 5, 5]
    assert SpeculativeConfig.from_dict(spec.to_dict()) == spec
    assert spec.max_draft_tokens == 5
    with pytest.raises(ValueError, match="draft_tokens"):
        SpeculativeConfig(draft_tokens=(2, -1))


# ----------------------------------------------------------------------------- the engine, greedy
class _Letters:
    """A detokenizer for stop strings: token i is the letter ``chr(97 + i % 26)``."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def _same_tokens(dense, spec) -> None:
    for i, (a, b) in enumerate(zip(dense.samples, spec.samples)):
        assert torch.equal(a.response_ids, b.response_ids), f"sample {i} differs at {_first_diff(a, b)}"
        assert (a.finish_reason, a.stop) == (b.finish_reason, b.stop)


def _first_diff(a, b) -> int:
    n = min(a.response_ids.numel(), b.response_ids.numel())
    diff = (a.response_ids[:n] != b.response_ids[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def _greedy_equality(engine, prompts, new_tokens: int, schedule: BudgetSchedule, ks: tuple[int, ...]) -> list:
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=())
    dense = engine.generate(prompts, greedy, BudgetSchedule.dense(schedule.bin_tokens, schedule.page_size))
    spec = engine.generate(prompts, greedy, schedule, speculative=SpeculativeConfig(draft_tokens=ks))
    _same_tokens(dense, spec)
    assert all(s.response_ids.numel() == new_tokens for s in spec.samples)
    for s, d in zip(spec.samples, dense.samples):
        assert isinstance(s, SpeculativeSample)
        torch.testing.assert_close(s.logprobs, d.logprobs, atol=1e-4, rtol=0)
    return [s.draft for s in spec.samples]


def test_greedy_speculative_equals_dense(engine: TorchRolloutEngine) -> None:
    logs = _greedy_equality(engine, random_prompts([37, 5, 60]), 160, DRAFT, (1, 4, 7, 3))  # k per bin
    accepted = torch.cat([d.accepted for d in logs])
    # the draft is wrong often and right often: both branches of the rule ran many times
    assert 0.1 < float(accepted.float().mean()) < 0.95 and int((~accepted).sum()) > 30
    assert sum(d.verifies for d in logs) < 0.8 * 3 * 160  # fewer dense passes than tokens


@pytest.mark.slow
def test_greedy_speculative_equals_dense_over_1k_tokens(engine: TorchRolloutEngine) -> None:
    logs = _greedy_equality(engine, random_prompts([37, 5]), 1100, DRAFT, (1, 4, 7, 3))
    assert int((~torch.cat([d.accepted for d in logs])).sum()) > 100


@pytest.mark.slow
def test_greedy_speculative_equals_dense_over_1k_tokens_warm_started() -> None:
    """The smoke recipe's warm-started policy (peaked, task-shaped distributions) with its sparsity geometry;
    the responses run on past EOS to 1,100 tokens, far beyond the task's lengths."""
    from policy._helpers import single_rank_env

    from sparrow_nemo.grpo.prompts import build_prompt_source
    from sparrow_nemo.grpo.recipe import load_config
    from sparrow_nemo.grpo.warmstart import ensure_warm_start

    config = load_config("tiny_cpu_short_smoke")
    source = build_prompt_source(config)
    with single_rank_env():
        path = ensure_warm_start(config, source, show_progress=False)
    s = config.sparsity
    engine = TorchRolloutEngine.from_hf_dir(
        path, dense_layers=s.dense_layers, page_size=s.page_size, attention_backend="torch"
    )
    draft = BudgetSchedule(bin_tokens=s.bin_tokens, budgets=(4 * s.page_size,), page_size=s.page_size)
    logs = _greedy_equality(engine, [i.prompt_ids for i in source.eval_batch(2)], 1100, draft, (2, 6))
    assert int((~torch.cat([d.accepted for d in logs])).sum()) > 20


def _first_seen(samples) -> dict[int, int]:
    """token -> the earliest index at which any sample's response has it."""
    first: dict[int, int] = {}
    for s in samples:
        for i, t in enumerate(s.response_ids.tolist()):
            first[t] = min(first.get(t, i), i)
    return first


def test_greedy_speculative_equals_dense_with_stops_inside_accepted_runs(engine: TorchRolloutEngine) -> None:
    prompts = random_prompts([12, 40, 23, 31, 8], seed=5)
    free = SamplingParams(max_new_tokens=150, temperature=0.0, stop_token_ids=())
    ref = engine.generate(prompts, free, DENSE)
    late = sorted((i, t) for t, i in _first_seen(ref.samples).items() if i >= 20)
    stop_ids = tuple(t for _, t in late[:3])  # never in the first 20 tokens, somewhere in some response
    stop_text = _Letters().decode(ref.samples[1].response_ids[90:93].tolist())
    engine.tokenizer = _Letters()
    inside = 0
    try:
        for sampling in (
            SamplingParams(max_new_tokens=150, temperature=0.0, stop_token_ids=stop_ids),
            SamplingParams(max_new_tokens=150, temperature=0.0, stop_token_ids=(), stop_strings=(stop_text,)),
        ):
            dense = engine.generate(prompts, sampling, DENSE)
            spec = engine.generate(prompts, sampling, DRAFT, speculative=SpeculativeConfig(draft_tokens=(6,)))
            _same_tokens(dense, spec)
            lengths = [s.response_ids.numel() for s in spec.samples]
            assert min(lengths) < 150 and len(set(lengths)) > 2  # rows stop at different points
            for s in spec.samples:
                if s.finish_reason != "length":  # accepted drafts past the stop: it ended an accepted run
                    last = int(s.cached_len[-1])
                    inside += int((s.draft.accepted & (s.draft.cached_len > last)).any())
    finally:
        engine.tokenizer = None
    assert inside >= 2  # (the loop checks that every page came back exactly once)


def test_greedy_speculative_uses_the_adapter_for_drafts_only(engine: TorchRolloutEngine) -> None:
    prompts = random_prompts([30, 18])
    greedy = SamplingParams(max_new_tokens=120, temperature=0.0, stop_token_ids=())
    dense = engine.generate(prompts, greedy, DENSE)
    gen = torch.Generator().manual_seed(7)
    weights = {
        name: (0.3 * torch.randn(4, n_in, generator=gen), 0.3 * torch.randn(n_out, 4, generator=gen))
        for name, (n_in, n_out) in linear_in_out(SHAPE).items()
    }
    engine.set_lora(LoraAdapter(weights=weights, scaling=2.0))
    try:
        with_adapter = engine.generate(prompts, greedy, DENSE)
        spec = engine.generate(prompts, greedy, DRAFT, speculative=SpeculativeConfig(draft_tokens=(4,)))
    finally:
        engine.set_lora(None)
    assert not torch.equal(with_adapter.samples[0].response_ids, dense.samples[0].response_ids)
    _same_tokens(dense, spec)


def test_logprobs_and_top_k_are_the_dense_scores(engine: TorchRolloutEngine) -> None:
    prompts = random_prompts([25, 9, 44], seed=2)
    sampling = SamplingParams(
        max_new_tokens=80, temperature=1.0, seed=4, stop_token_ids=(SHAPE.eos_token_id,)
    )
    spec = engine.generate(prompts, sampling, DRAFT, speculative=SpeculativeConfig(draft_tokens=(5,)))
    scored = engine.score([s.prompt_ids.tolist() + s.response_ids.tolist() for s in spec.samples])
    for s, ref in zip(spec.samples, scored):
        n, lp = s.prompt_ids.numel(), s.response_ids.numel()
        torch.testing.assert_close(s.logprobs, ref.logprobs[n - 1 :], atol=1e-5, rtol=0)
        torch.testing.assert_close(s.top_logprobs, ref.top_logprobs[n - 1 :], atol=1e-5, rtol=0)
        assert float((s.top_ids == ref.top_ids[n - 1 :]).float().mean()) > 0.99  # up to near-ties
        assert s.cached_len.tolist() == list(range(n, n + lp))
        assert bool((s.kv_budget == DENSE_BUDGET).all())
        d = s.draft
        assert d.cached_len.shape == d.alpha.shape == d.accepted.shape == d.budget.shape
        assert bool((d.budget == 20).all()) and bool(((d.alpha >= 0) & (d.alpha <= 1 + 1e-6)).all())
        # tests may run past a stop inside an accepted run, never past that round's k = 5 drafts
        assert bool((d.cached_len >= n + 1).all()) and bool((d.cached_len <= n + lp + 5).all())


def test_a_sample_is_the_same_alone_and_in_a_batch_and_k0_is_dense_sampling(
    engine: TorchRolloutEngine,
) -> None:
    prompts = random_prompts([14, 33, 7, 21], seed=9)
    sampling = SamplingParams(max_new_tokens=60, temperature=1.0, seed=11, stop_token_ids=())
    spec_cfg = SpeculativeConfig(draft_tokens=(3,))
    batch = engine.generate(prompts, sampling, DRAFT, speculative=spec_cfg)
    alone = engine.generate(
        prompts[2:3], sampling, DRAFT, speculative=spec_cfg, sample_seeds=[sample_seed(sampling.seed, 2)]
    )
    assert torch.equal(alone.samples[0].response_ids, batch.samples[2].response_ids)
    dense = engine.generate(prompts, sampling, DENSE)
    k0 = engine.generate(prompts, sampling, DRAFT, speculative=SpeculativeConfig(draft_tokens=(0,)))
    _same_tokens(dense, k0)
    assert all(s.draft.drafted == 0 and s.draft.verifies == 59 for s in k0.samples)


def test_greedy_speculative_with_minmax_drafts_equals_dense() -> None:
    """The draft selects pages by key bounds (its cache keeps them, rebuilt after every round): still exactly
    dense greedy, and the drafts are not all accepted (the budget really bites)."""
    minmax = make_engine(page_score="minmax")
    assert minmax._pool(1).key_min and not minmax._pool(1).centroids
    logs = _greedy_equality(minmax, random_prompts([37, 5, 60]), 160, DRAFT, (1, 4, 7, 3))
    accepted = torch.cat([d.accepted for d in logs])
    assert 0.1 < float(accepted.float().mean()) < 0.99 and int((~accepted).sum()) > 5


# ----------------------------------------------------------------------------- the cache after a round
def landmarks(cache: PagedKVCache, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
    """The page landmarks of the cache's page score for one row of ``length`` tokens, [1, Hkv, P, D] each."""
    seq = torch.tensor([length])
    if cache.page_score == "minmax":
        return cache.gather_key_bounds(layer, table, seq)
    return (cache.gather_centroids(layer, table, seq),)


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
def test_rollback_leaves_the_cache_of_a_run_that_never_saw_the_rejected_tokens(
    engine: TorchRolloutEngine, page_score: str
) -> None:
    """Draft 6 tokens sparsely, verify them densely, keep 2 (+ the pending one): the keys, values and
    landmarks of the kept positions equal those of a cache that only ever appended those 3 tokens densely
    (to float rounding: the verify computes the same keys in one forward), and the landmarks are bit for bit
    those of appending the kept keys one by one (key bounds: also ``page_key_bounds`` of the kept keys)."""
    model = engine.model
    step = DecodeStep(model, TorchDecode(), dense_layers=1, sink_pages=1, local_pages=2)
    prompt = random_prompts([29], seed=4)[0]
    stream = random_prompts([7], seed=8)[0]  # pending token + 6 drafts (any tokens: the cache is what counts)
    kept = 3  # the pending token and 2 accepted drafts

    def fresh() -> tuple[PagedKVCache, torch.Tensor, torch.Tensor]:
        cache = PagedKVCache(
            SHAPE.num_layers, 32, SHAPE.num_key_value_heads, SHAPE.head_dim, PAGE, page_score=page_score
        )
        table = torch.full((1, 16), -1, dtype=torch.int32)
        length = torch.tensor([len(prompt)])
        fill_block_table(BlockManager(32, PAGE), table, length + 8)
        engine.runner.dense_prefill(cache, table, torch.tensor([prompt]), length, lambda start, h: None)
        return cache, table, length

    never, table_n, start = fresh()
    for j in range(kept):  # dense appends of the kept tokens only
        step(never, table_n, torch.tensor([stream[j]]), start + j + 1, None)
    spec, table_s, _ = fresh()
    for j in range(6):  # the draft writes 6 positions with sparse attention
        step(spec, table_s, torch.tensor([stream[j]]), start + j + 1, torch.tensor([20]))
    forward_tokens(
        model, TorchVerify(), spec, table_s, torch.tensor([stream]), start, torch.ones(1, 7, dtype=torch.bool)
    )
    rebuild_landmarks(spec, table_s, start, start + kept)
    length = int(start) + kept
    for layer in range(SHAPE.num_layers):
        k_n, v_n = never.contiguous(layer, table_n, torch.tensor([length]))
        k_s, v_s = spec.contiguous(layer, table_s, torch.tensor([length]))
        torch.testing.assert_close(k_s, k_n, atol=1e-5, rtol=0)
        torch.testing.assert_close(v_s, v_n, atol=1e-5, rtol=0)
        for c_s, c_n in zip(
            landmarks(spec, layer, table_s, length), landmarks(never, layer, table_n, length)
        ):
            torch.testing.assert_close(c_s, c_n, atol=1e-5, rtol=0)
        if page_score == "minmax":  # the bounds are those of the kept keys only
            bounds = page_key_bounds(k_s, torch.tensor([length]), PAGE)
            assert all(map(torch.equal, landmarks(spec, layer, table_s, length), bounds))
    # exactly: the rebuilt landmarks are those of appending the kept (dense) keys one by one
    replay, table_r, _ = fresh()
    for layer in range(SHAPE.num_layers):
        k_s, v_s = spec.contiguous(layer, table_s, torch.tensor([length]))
        for pos in range(int(start), length):
            at = torch.tensor([pos])
            replay.append(layer, table_r, at, k_s[:, :, pos], v_s[:, :, pos])
        mine, theirs = landmarks(spec, layer, table_s, length), landmarks(replay, layer, table_r, length)
        assert all(map(torch.equal, mine, theirs))
    # and the draft's keys really were different before the verify overwrote them (layer 2 is sparse)
    probe, table_p, _ = fresh()
    for j in range(6):
        step(probe, table_p, torch.tensor([stream[j]]), start + j + 1, torch.tensor([20]))
    k_p, _ = probe.contiguous(2, table_p, torch.tensor([length]))
    k_n, _ = never.contiguous(2, table_n, torch.tensor([length]))
    assert float((k_p - k_n).abs().max()) > 1e-3


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
def test_rebuild_landmarks_are_those_of_the_keys_below_the_length(page_score: str) -> None:
    cache = PagedKVCache(2, 12, 2, 8, page_size=4, page_score=page_score)
    gen = torch.Generator().manual_seed(1)
    for pool in cache.k_pages:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    table = torch.tensor([[3, 7, 1, 0], [2, 5, 9, 4]], dtype=torch.int32)
    start, length = torch.tensor([5, 2]), torch.tensor([10, 15])
    rebuild_landmarks(cache, table, start, length)
    for layer, (b, logical) in itertools.product(range(2), [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3)]):
        n = min(4, int(length[b]) - 4 * logical)
        phys = int(table[b, logical])
        keys = cache.k_pages[layer][phys, :, :n]
        if page_score == "minmax":
            assert torch.equal(cache.key_min[layer][phys], keys.amin(dim=1))
            assert torch.equal(cache.key_max[layer][phys], keys.amax(dim=1))
        else:
            torch.testing.assert_close(cache.centroids[layer][phys], keys.mean(dim=1), atol=1e-6, rtol=0)
    assert all(bool((pool[3] == 0).all()) for pool in cache.landmarks(0))  # page 0 of row 0 is before start
