"""The policy's sparse teacher-forced forward reproduces the sparse rollout engine (fp32, CPU).

- the pages each query attends to equal the method layer's ``select_pages`` run on each position's own
  cache prefix (integer-valued q/k: exact scores, ties included), block by block, under both page scores;
  the minmax page scores equal ``key_bound_scores`` on float inputs;
- the block attention over the gathered pages equals softmax attention under the full per-query mask
  (values and gradients);
- policy sparse logprobs == the torch rollout engine's sampled-token logprobs (max abs diff < 1e-4),
  with and without a LoRA adapter exported to the engine, for local_pages 2 and 0 (0 makes the
  current partial page's landmarks matter), under both page scores, while the dense logprobs differ clearly;
- under both page scores (centroid and minmax), policy sparse logprobs == a reference where every position's
  attention is the method layer's ``sparse_decode_attention(..., page_score=...)`` over its own cache prefix
  (token-by-token decoding, teacher-forced), every layer sparse, local_pages 2 and 0.
"""

from __future__ import annotations

import pytest
import torch

from policy._helpers import make_hf_checkpoint, single_rank_env
from sparrow_nemo.grpo.rollout_step import pad_pairs
from sparrow_nemo.hf_qwen3 import LoraAdapter
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy import sparse_forward
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.lora import LoraConfig, init_adapter
from sparrow_nemo.policy.memory import MemorySettings
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy
from sparrow_nemo.policy.sparse_forward import SparsePlan
from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.sparse.attention import (
    group_mean_query,
    key_bound_scores,
    page_key_bounds,
    select_pages,
    selected_token_mask,
    sparse_decode_attention,
)
from sparrow_nemo.sparse.pattern import SparsePattern
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

TOL = 1e-4  # max abs logprob difference, fp32 (different matmul groupings)
PAGE = 4
SCHEDULE = BudgetSchedule(bin_tokens=16, budgets=(12, 16, 20), page_size=PAGE, name="test")
SHAPE = PRESETS["tiny-test"]


def _token_mask(q, k, plan, pattern) -> torch.Tensor:
    """bool [B, Hkv, S, S] from :func:`query_block_pages`, block by block (the test's dense reference)."""
    s = q.shape[2]
    landmarks = sparse_forward.page_landmarks(k, pattern)
    rows = []
    for lo in range(0, s, sparse_forward.QUERY_BLOCK):
        hi = min(lo + sparse_forward.QUERY_BLOCK, s)
        pages = sparse_forward.query_block_pages(q, k, landmarks, plan, pattern, lo, hi)  # [B, n, Hkv, P]
        tokens = pages.repeat_interleave(pattern.page_size, dim=3)[..., :s]
        causal = torch.arange(s)[None, :] <= torch.arange(lo, hi)[:, None]
        rows.append((tokens & causal[None, :, None, :]).transpose(1, 2))
    return torch.cat(rows, dim=2)


def _random_plan(g, b, s, prompt_lens) -> SparsePlan:
    budget = torch.randint(0, 7, (b, s), generator=g) * PAGE
    budget[1, 20] = DENSE_BUDGET
    return SparsePlan(prompt_lens, torch.where(torch.arange(s) < prompt_lens[:, None], DENSE_BUDGET, budget))


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
def test_pages_equal_method_layer_selection_per_position(monkeypatch, page_score):
    monkeypatch.setattr(sparse_forward, "QUERY_BLOCK", 8)  # several blocks, one straddling a page
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, s, d = 2, 4, 2, 37, 8
    q = torch.randint(-3, 4, (b, hq, s, d), generator=g).float()
    k = torch.randint(-3, 4, (b, hkv, s, d), generator=g).float()
    prompt_lens = torch.tensor([5, 9])
    plan = _random_plan(g, b, s, prompt_lens)
    for local in (2, 0):
        pattern = SparsePattern(page_size=PAGE, sink_pages=1, local_pages=local, page_score=page_score)
        mask = _token_mask(q, k, plan, pattern)
        for row in range(b):
            for t in range(s):
                got = mask[row, :, t]
                if t < int(prompt_lens[row]):
                    assert got[:, : t + 1].all() and not got[:, t + 1 :].any()
                    continue
                seq = torch.tensor([t + 1])
                idx = select_pages(
                    q[row : row + 1, :, t],
                    k[row : row + 1, :, : t + 1],
                    seq,
                    plan.query_budget[row, t : t + 1],
                    PAGE,
                    1,
                    local,
                    page_score,
                )
                want = selected_token_mask(idx, seq, t + 1, PAGE)[0]
                assert torch.equal(got[:, : t + 1], want), (row, t, local)
                assert not got[:, t + 1 :].any()
    n_kept = mask[:, :, 20:].sum(-1)
    assert (n_kept < torch.arange(21, s + 1)).any(), "some decode rows must drop pages"


def test_minmax_page_scores_equal_the_method_layers_key_bound_scores():
    """score_pages sums q+ . max + q- . min by matmul: the method layer's bound up to the fp32 sum order."""
    g = torch.Generator().manual_seed(2)
    b, hq, hkv, s, d = 2, 4, 2, 37, 16
    q, k = torch.randn(b, hq, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    pattern = SparsePattern(page_size=PAGE, page_score="minmax")
    complete = s // PAGE  # the last, partial page is re-summarised per query (query_block_pages)
    landmarks = tuple(m[:, :, :complete] for m in sparse_forward.page_landmarks(k, pattern))
    k_min, k_max = (m[:, :, :complete] for m in page_key_bounds(k, torch.full((b,), s), PAGE))
    torch.testing.assert_close(landmarks, (k_max, k_min), atol=0, rtol=0)
    q_mean = group_mean_query(q, hkv)
    got = sparse_forward.score_pages(q_mean, landmarks, "minmax", "bhd,bhpd->bhp")
    torch.testing.assert_close(got, key_bound_scores(q_mean, k_min, k_max), atol=1e-5, rtol=0)


def test_block_attention_equals_dense_masked_attention_values_and_gradients(monkeypatch):
    """The gathered-pages block attention == softmax attention under the full [S, S] per-query mask."""
    monkeypatch.setattr(sparse_forward, "QUERY_BLOCK", 8)
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, s, d = 2, 4, 2, 37, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
    plan = _random_plan(g, b, s, torch.tensor([5, 9]))
    pattern = SparsePattern(page_size=PAGE, sink_pages=1, local_pages=0)
    out = sparse_forward.block_sparse_attention(q, k, v, plan, pattern)
    weights = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    mask = _token_mask(q.detach(), k.detach(), plan, pattern).repeat_interleave(hq // hkv, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=mask
    )
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _rollout(engine: TorchRolloutEngine, prompts: list[torch.Tensor]):
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, stop_token_ids=())
    return engine.generate(prompts, sampling, SCHEDULE).samples


def _policy_inputs(samples) -> tuple[PolicyBatch, SparsePlan, torch.Tensor]:
    tokens, lengths, mask = pad_pairs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    prompt_lens = torch.tensor([s.prompt_ids.numel() for s in samples])
    plan = SparsePlan.from_schedule(SCHEDULE, prompt_lens, tokens.shape[1])
    recorded = SparsePlan.from_rollouts(prompt_lens.tolist(), [s.kv_budget for s in samples], tokens.shape[1])
    # the plan's budget of the query predicting response token i is the engine's kv_budget[i]
    assert torch.equal(plan.query_budget[:, :-1][mask], torch.cat([s.kv_budget for s in samples]))
    assert torch.equal(recorded.query_budget[:, :-1][mask], plan.query_budget[:, :-1][mask])
    return PolicyBatch(tokens, lengths), recorded, mask


def random_lora(seed: int) -> tuple[LoraConfig, LoraAdapter]:
    config = LoraConfig(rank=4, alpha=8.0)
    fresh = init_adapter(SHAPE, config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    weights = {n: (a, 0.3 * torch.randn(b.shape, generator=g)) for n, (a, b) in fresh.weights.items()}
    return config, LoraAdapter(weights=weights, scaling=fresh.scaling)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(SHAPE, tmp_path_factory.mktemp("sparse_fwd") / "hf")


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
@pytest.mark.parametrize("local_pages", [2, 0])
def test_sparse_logprobs_equal_engine_with_and_without_lora(checkpoint, local_pages, page_score):
    pattern = SparsePattern(PAGE, 1, local_pages, dense_layers=1, page_score=page_score)
    engine = TorchRolloutEngine.from_hf_dir(
        checkpoint,
        dense_layers=1,
        page_size=PAGE,
        sink_pages=1,
        local_pages=local_pages,
        attention_backend="torch",
        page_score=page_score,
    )
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g) for n in (7, 13)]
    settings = OptimizerSettings(lr=1e-3)
    with single_rank_env():
        policy = MegatronPolicy(SHAPE, ParallelLayout(), settings, "float32", hf_dir=checkpoint)
        try:
            samples = _rollout(engine, prompts)
            batch, plan, mask = _policy_inputs(samples)
            engine_lp = torch.cat([s.logprobs for s in samples])
            sparse = policy.sparse_logprobs([batch], [plan], pattern)[0].logprobs[mask]
            dense = policy.logprobs([batch])[0].logprobs[mask]
            assert (sparse - engine_lp).abs().max().item() < TOL
            assert (dense - engine_lp).abs().max().item() > 0.05, "the schedule must change some tokens"

            config, adapter = random_lora(seed=5)
            policy.enable_lora(config, adapter)
            exported = policy.lora.export_adapter()
            assert set(exported.weights) == set(adapter.weights)
            for name, (a, b) in adapter.weights.items():  # import -> export is bit-exact
                assert torch.equal(exported.weights[name][0], a) and torch.equal(exported.weights[name][1], b)
            engine.set_lora(exported)
            lora_samples = _rollout(engine, prompts)
            batch, plan, mask = _policy_inputs(lora_samples)
            engine_lp = torch.cat([s.logprobs for s in lora_samples])
            with_lora = policy.sparse_logprobs([batch], [plan], pattern)[0].logprobs[mask]
            without = policy.sparse_logprobs([batch], [plan], pattern, use_lora=False)[0].logprobs[mask]
            assert (with_lora - engine_lp).abs().max().item() < TOL
            assert (without - engine_lp).abs().max().item() > 0.05, "the adapter must matter"
            # the adapter never reaches the dense path
            assert torch.equal(policy.logprobs([batch])[0].logprobs, _dense_without_adapter(policy, batch))
        finally:
            policy.close()


def _dense_without_adapter(policy: MegatronPolicy, batch: PolicyBatch) -> torch.Tensor:
    hooks, policy.lora = policy.lora, None
    try:
        hooks.remove()
        return policy.logprobs([batch])[0].logprobs
    finally:
        policy.lora = hooks


def _method_layer_logprobs(
    model: Qwen3Decoder, ids: torch.Tensor, budgets: torch.Tensor, pattern: SparsePattern
) -> torch.Tensor:
    """Teacher-forced logprobs [T-1] of ids[1:] (ids [T]) where each position t attends, in every layer from
    ``pattern.dense_layers`` on, like a decode step with t + 1 cached tokens: the method layer's
    ``sparse_decode_attention`` over the cache prefix 0..t under ``budgets[t]`` (one batch row per position;
    since each layer is causal this equals decoding the sequence token by token)."""
    length = ids.numel()
    positions = torch.arange(length)
    h = model.embed(ids)
    for layer in range(model.shape.num_layers):
        q, k, v = model.attention_inputs(layer, h, positions)  # [T, Hq | Hkv, D]
        k_cache = k.transpose(0, 1)[None].expand(length, -1, -1, -1)  # row t: the cache of position t
        v_cache = v.transpose(0, 1)[None].expand(length, -1, -1, -1)
        budget = DENSE_BUDGET if layer < pattern.dense_layers else budgets
        out = sparse_decode_attention(
            q,
            k_cache,
            v_cache,
            positions + 1,
            budget,
            pattern.page_size,
            pattern.sink_pages,
            pattern.local_pages,
            pattern.page_score,
        )
        h = model.attention_output(layer, h, out)
    logprobs = torch.log_softmax(model.logits(h), dim=-1)
    return logprobs[:-1].gather(-1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("page_score", ["centroid", "minmax"])
def test_sparse_logprobs_equal_method_layer_decoding_per_page_score(checkpoint, page_score):
    g = torch.Generator().manual_seed(12)
    lengths, prompt_lens = torch.tensor([52, 43]), torch.tensor([7, 13])
    tokens = torch.randint(0, SHAPE.vocab_size, (2, 52), generator=g)
    tokens[torch.arange(52) >= lengths[:, None]] = 0
    batch = PolicyBatch(tokens, lengths)
    plan = SparsePlan.from_schedule(SCHEDULE, prompt_lens, 52)
    model = Qwen3Decoder.from_hf_dir(checkpoint)
    with single_rank_env():
        policy = MegatronPolicy(
            SHAPE, ParallelLayout(), OptimizerSettings(lr=1e-3), "float32", hf_dir=checkpoint
        )
        try:
            dense = policy.logprobs([batch])[0].logprobs
            for local in (2, 0):
                pattern = SparsePattern(PAGE, 1, local, dense_layers=0, page_score=page_score)
                other = "centroid" if page_score == "minmax" else "minmax"
                got, rival = (
                    policy.sparse_logprobs([batch], [plan], p)[0].logprobs
                    for p in (pattern, SparsePattern(PAGE, 1, local, dense_layers=0, page_score=other))
                )
                for row, n in enumerate(lengths.tolist()):
                    want = _method_layer_logprobs(model, tokens[row, :n], plan.query_budget[row, :n], pattern)
                    assert (got[row, : n - 1] - want).abs().max().item() < TOL, (row, local)
                    assert (dense[row, : n - 1] - want).abs().max().item() > 0.05, "budgets must drop pages"
                assert (got - rival).abs().max().item() > 0.05, (
                    f"{page_score} must choose other pages than {other}"
                )
        finally:
            policy.close()


def test_plan_and_pattern_refuse_bad_input():
    with pytest.raises(ValueError, match="query_budget"):
        SparsePlan(torch.tensor([3]), torch.zeros(1, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="prompt_lens"):
        SparsePlan(torch.tensor([3, 4]), torch.zeros(1, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="page_size"):
        SparsePattern(page_size=0)
    with pytest.raises(ValueError, match="dense_layers"):
        SparsePattern(dense_layers=-1)


def _two_micro_batches() -> tuple[list[PolicyBatch], list[SparsePlan]]:
    """Two micro-batches of one shape whose plans differ (the schedule vs a fixed 2-page budget)."""
    g = torch.Generator().manual_seed(4)
    batches, plans = [], []
    for fixed in (False, True):
        lengths = torch.tensor([30, 26])
        tokens = torch.randint(0, SHAPE.vocab_size, (2, 30), generator=g)
        tokens[torch.arange(30) >= lengths[:, None]] = 0
        prompt_lens = torch.tensor([6, 4])
        plan = SparsePlan.from_schedule(SCHEDULE, prompt_lens, 30)
        if fixed:
            plan = SparsePlan(
                prompt_lens, torch.where(plan.query_budget == DENSE_BUDGET, DENSE_BUDGET, 2 * PAGE)
            )
        batches.append(PolicyBatch(tokens, lengths, {"adv": torch.randn(2, generator=g)}))
        plans.append(plan)
    return batches, plans


def _adv_loss(out, batch):
    mask = batch.target_mask().float()
    return -(batch.extras["adv"][:, None] * out.logprobs * mask).sum() / mask.sum(), {}


def _adapter_step(checkpoint, memory: MemorySettings):
    batches, plans = _two_micro_batches()
    pattern = SparsePattern(page_size=PAGE, sink_pages=1, local_pages=1, dense_layers=1)
    with single_rank_env():
        policy = MegatronPolicy(
            SHAPE, ParallelLayout(), OptimizerSettings(lr=1e-3), "float32", hf_dir=checkpoint, memory=memory
        )
        try:
            policy.enable_lora(*random_lora(seed=5))
            optimizer = policy.lora_optimizer(OptimizerSettings(lr=1e-2, weight_decay=0.0, grad_clip=0.0))
            result = policy.lora_train_step(batches, plans, pattern, _adv_loss, optimizer)
            return result.loss, policy.lora.export_adapter(grads=True).weights
        finally:
            policy.close()


def test_recomputed_layers_see_their_own_micro_batch_plan(checkpoint):
    """Full recompute re-runs each sparse layer in the backward, after every forward (GPipe on CPU, 1F1B on
    GPU): the recomputed attention must use its own micro-batch's plan, not the last one started."""
    loss, grads = _adapter_step(checkpoint, MemorySettings())
    loss_rc, grads_rc = _adapter_step(checkpoint, MemorySettings(recompute_granularity="full"))
    assert loss_rc == pytest.approx(loss, abs=1e-6)
    assert set(grads_rc) == set(grads)
    for name, (a, b) in grads.items():
        torch.testing.assert_close(grads_rc[name][0], a, atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(grads_rc[name][1], b, atol=1e-6, rtol=0, msg=name)
    assert max(float(b.abs().max()) for _, b in grads.values()) > 1e-4, "the adapter must get gradients"
