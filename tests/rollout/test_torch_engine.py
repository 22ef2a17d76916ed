"""The torch rollout engine against transformers (dense) and a contiguous-cache reference (sparse)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from sparrow_nemo.hf_qwen3 import LoraAdapter, linear_in_out
from sparrow_nemo.rollout import (
    RolloutEngine,
    SamplingParams,
    TorchRolloutEngine,
)
from sparrow_nemo.rollout.sampling import sample_seed
from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

from ._helpers import SHAPE, contiguous_reference

DENSE = BudgetSchedule.dense()
TOL = 1e-4


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SHAPE.vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def engine(hf_dir: Path) -> TorchRolloutEngine:
    return TorchRolloutEngine.from_hf_dir(hf_dir, attention_backend="torch")


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=(), **kw)


# --------------------------------------------------------------------------- dense == policy
def test_dense_schedule_logprobs_match_transformers(engine: TorchRolloutEngine, hf_dir: Path) -> None:
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    batch = engine.generate(prompts([21, 4, 40]), SamplingParams(max_new_tokens=24, seed=1), DENSE)
    worst = 0.0
    for s in batch.samples:
        ids = torch.cat([s.prompt_ids, s.response_ids])
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)[s.prompt_ids.numel() - 1 : -1]
        worst = max(worst, float((s.logprobs - ref.gather(-1, s.response_ids[:, None])[:, 0]).abs().max()))
        worst = max(worst, float((s.top_logprobs - torch.topk(ref, 20, -1).values).abs().max()))
        assert torch.equal(s.kv_budget, torch.full_like(s.kv_budget, DENSE_BUDGET))
    assert worst < TOL


def test_budget_covering_the_sequence_equals_dense_bit_exactly(engine: TorchRolloutEngine) -> None:
    p = prompts([50, 9])
    dense = engine.generate(p, SamplingParams(max_new_tokens=20, seed=4), DENSE)
    wide = engine.generate(
        p, SamplingParams(max_new_tokens=20, seed=4), BudgetSchedule.from_preset("fixed:96")
    )
    for a, b in zip(dense.samples, wide.samples):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)


# --------------------------------------------------------------------------- sparse == method layer
@torch.no_grad()
@pytest.mark.parametrize("dense_layers", [0, 2])
def test_sparse_decode_equals_contiguous_method_layer_reference(hf_dir: Path, dense_layers: int) -> None:
    """Three prompt lengths, budgets growing with the cached length; all or only the last layer sparse."""
    engine = TorchRolloutEngine.from_hf_dir(hf_dir, dense_layers=dense_layers, attention_backend="torch")
    schedule = BudgetSchedule(bin_tokens=40, budgets=(48, 64, 80), name="test")
    p = prompts([70, 6, 33], seed=5)
    batch = engine.generate(p, greedy(60), schedule)
    for prompt, s in zip(p, batch.samples):
        tokens, logprobs = contiguous_reference(engine.model, prompt, 60, schedule, dense_layers)
        assert s.response_ids.tolist() == tokens
        assert (s.logprobs - logprobs).abs().max() < 1e-5
    dense = engine.generate(p, greedy(60), DENSE)
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(batch.samples, dense.samples))


def test_budgets_switch_exactly_at_bin_boundaries(engine: TorchRolloutEngine) -> None:
    """Same greedy run under fixed:48 and under (48 then 96 from cached length 64 on): identical up to
    the token sampled at cached length 63, different at cached length 64."""
    p = prompts([40])
    low = engine.generate(p, greedy(40), BudgetSchedule.from_preset("fixed:48")).samples[0]
    step = BudgetSchedule(bin_tokens=64, budgets=(48, 96), name="step")
    switched = engine.generate(p, greedy(40), step).samples[0]
    assert switched.cached_len.tolist() == list(range(40, 80))
    expected = [DENSE_BUDGET] + [48 if c < 64 else 96 for c in range(41, 80)]
    assert switched.kv_budget.tolist() == expected
    before = switched.cached_len < 64
    assert torch.equal(switched.response_ids[before], low.response_ids[before])
    assert torch.equal(switched.logprobs[before], low.logprobs[before])
    at = int(torch.nonzero(switched.cached_len == 64))
    assert switched.logprobs[at] != low.logprobs[at]


# --------------------------------------------------------------------------- sampling and batching
def test_generation_is_deterministic_for_a_seed(engine: TorchRolloutEngine) -> None:
    p = prompts([12, 30])
    params = SamplingParams(
        max_new_tokens=30, temperature=0.9, top_p=0.95, top_k=40, seed=7, stop_token_ids=()
    )
    a = engine.generate(p, params, BudgetSchedule.from_preset("fixed:32"))
    b = engine.generate(p, params, BudgetSchedule.from_preset("fixed:32"))
    other = engine.generate(
        p, SamplingParams(**{**params.__dict__, "seed": 8}), BudgetSchedule.from_preset("fixed:32")
    )
    for x, y, z in zip(a.samples, b.samples, other.samples):
        assert torch.equal(x.response_ids, y.response_ids) and torch.equal(x.logprobs, y.logprobs)
        assert not torch.equal(x.response_ids, z.response_ids)


def test_mixed_length_batch_equals_each_prompt_alone(engine: TorchRolloutEngine) -> None:
    """Sampled (not greedy) with stop tokens, so samples finish at different steps and leave the batch."""
    p = prompts([5, 47, 18, 33], seed=2)
    stops = tuple(range(3, 9))
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, stop_token_ids=stops)
    sched = BudgetSchedule(bin_tokens=32, budgets=(48, 64), name="t")
    batch = engine.generate(p, params, sched)
    lengths = [s.response_ids.numel() for s in batch.samples]
    assert len(set(lengths)) > 1 and any(s.finish_reason == "stop_token" for s in batch.samples)
    waves = TorchRolloutEngine(engine.model, max_batch_size=3).generate(p, params, sched)
    for a, b in zip(batch.samples, waves.samples):
        assert torch.equal(a.response_ids, b.response_ids) and (a.logprobs - b.logprobs).abs().max() < 1e-5
    for i, (prompt, s) in enumerate(zip(p, batch.samples)):
        alone = engine.generate([prompt], params, sched, sample_seeds=[sample_seed(params.seed, i)]).samples[
            0
        ]
        assert torch.equal(alone.response_ids, s.response_ids)
        assert (alone.logprobs - s.logprobs).abs().max() < 1e-5
        assert alone.finish_reason == s.finish_reason
        if s.finish_reason == "stop_token":
            assert s.stop == int(s.response_ids[-1]) and s.stop in stops
        else:
            assert s.finish_reason == "length" and s.response_ids.numel() == 40


@pytest.mark.parametrize("running", [None, 4])
def test_repeated_prompts_are_prefilled_once_with_the_same_samples(
    engine: TorchRolloutEngine, running: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GRPO-like batch (each prompt 3 times, interleaved): one prefill row per distinct prompt, also when the
    samples are admitted over several steps (4 running at most), and every sample equals the one generated
    alone with the same per-sample seed."""
    distinct = prompts([21, 40, 9], seed=4)
    batch = [distinct[i % 3] for i in range(9)]
    seeds = [sample_seed(1, i) for i in range(9)]
    params = SamplingParams(max_new_tokens=14, temperature=1.0, seed=1, stop_token_ids=(3, 4))
    sched = BudgetSchedule(bin_tokens=32, budgets=(32, 48), name="t")
    eng = TorchRolloutEngine(engine.model, max_batch_size=running)
    rows: list[int] = []
    original = eng.runner.dense_prefill

    def counting(cache, table, ids, lengths, emit):
        rows.append(ids.shape[0])
        return original(cache, table, ids, lengths, emit)

    monkeypatch.setattr(eng.runner, "dense_prefill", counting)
    shared = eng.generate(batch, params, sched, sample_seeds=seeds)
    assert sum(rows) == 3
    for i, s in enumerate(shared.samples):
        alone = engine.generate([batch[i]], params, sched, sample_seeds=[seeds[i]]).samples[0]
        assert torch.equal(alone.response_ids, s.response_ids) and torch.equal(alone.cached_len, s.cached_len)
        assert (alone.logprobs - s.logprobs).abs().max() < 1e-5


def test_chunked_prefill_equals_whole_prompt_prefill(engine: TorchRolloutEngine) -> None:
    p, params = prompts([40, 7, 33, 16]), SamplingParams(max_new_tokens=12, seed=5, stop_token_ids=())
    sched = BudgetSchedule(bin_tokens=48, budgets=(32, 48), name="t")
    whole = engine.generate(p, params, sched)
    chunked = TorchRolloutEngine(engine.model, prefill_chunk_tokens=16).generate(p, params, sched)
    for a, b in zip(whole.samples, chunked.samples):
        assert torch.equal(a.response_ids, b.response_ids) and (a.logprobs - b.logprobs).abs().max() < 1e-5
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be a positive multiple of page_size=16"):
        TorchRolloutEngine(engine.model, prefill_chunk_tokens=20)


def test_finished_sequences_leave_the_batch(
    engine: TorchRolloutEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows: list[int] = []
    original = engine.runner.step

    def counting(cache, block_table, tokens, seq_len, budgets):
        rows.append(tokens.shape[0])
        return original(cache, block_table, tokens, seq_len, budgets)

    monkeypatch.setattr(engine.runner, "step", counting)
    params = SamplingParams(max_new_tokens=30, seed=11, stop_token_ids=tuple(range(3, 10)))
    batch = engine.generate(prompts([8, 8, 8, 8], seed=9), params, DENSE)
    lengths = [s.response_ids.numel() for s in batch.samples]
    # every decode step runs exactly the sequences that still need a token
    assert sum(rows) == sum(n - 1 for n in lengths)
    assert rows == sorted(rows, reverse=True) and rows[-1] < 4


def test_stop_strings_and_length_cap(hf_dir: Path) -> None:
    class Letters:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    engine = TorchRolloutEngine.from_hf_dir(hf_dir, tokenizer=Letters())
    p = prompts([10])
    free = engine.generate(p, greedy(30), DENSE).samples[0]
    assert free.finish_reason == "length" and free.response_ids.numel() == 30 and free.stop is None
    text = Letters().decode(free.response_ids.tolist())
    stop = text[12:14]
    first = text.index(stop) + len(stop)  # the stop string is complete after this many tokens
    stopped = engine.generate(p, greedy(30, stop_strings=(stop,)), DENSE).samples[0]
    assert stopped.finish_reason == "stop_string" and stopped.stop == stop
    assert stopped.response_ids.tolist() == free.response_ids.tolist()[:first]
    with pytest.raises(ValueError, match="tokenizer"):
        TorchRolloutEngine(engine.model).generate(p, greedy(3, stop_strings=("x",)), DENSE)
    capped = TorchRolloutEngine(Qwen3Decoder(SHAPE.replace(max_position_embeddings=16), engine.model.params))
    assert capped.generate(p, greedy(30), DENSE).samples[0].response_ids.numel() == 6


def test_bad_inputs_are_clear_errors(engine: TorchRolloutEngine) -> None:
    with pytest.raises(ValueError, match="prompt 1 has token ids"):
        engine.generate([[1, 2], [5, 999]], greedy(2), DENSE)
    with pytest.raises(ValueError, match="prompt 0 must be a non-empty"):
        engine.generate([[]], greedy(2), DENSE)
    with pytest.raises(ValueError, match="page_size=32"):
        engine.generate([[1]], greedy(2), BudgetSchedule(bin_tokens=64, budgets=(64,), page_size=32))
    with pytest.raises(ValueError, match="sample_seeds has 1 entries for 2 prompts"):
        engine.generate([[1], [2]], greedy(2), DENSE, sample_seeds=[3])
    assert engine.score([]) == [] and engine.generate([], greedy(2), DENSE).samples == []
    with pytest.raises(ValueError, match="attention_backend"):
        TorchRolloutEngine(engine.model, attention_backend="cuda")


# --------------------------------------------------------------------------- weights, LoRA, sleep
def test_update_weights_changes_outputs_and_equals_a_fresh_engine(hf_dir: Path) -> None:
    engine = TorchRolloutEngine.from_hf_dir(hf_dir)
    other = Qwen3Decoder.random(SHAPE, seed=5)
    p, params = prompts([9, 20]), SamplingParams(max_new_tokens=16, seed=2)
    sched = BudgetSchedule.from_preset("fixed:16")
    before = engine.generate(p, params, sched)
    storage = engine.model.params["model.layers.0.self_attn.q_proj.weight"].data_ptr()
    engine.update_weights(other.params)
    assert engine.model.params["model.layers.0.self_attn.q_proj.weight"].data_ptr() == storage  # in place
    after = engine.generate(p, params, sched)
    fresh = TorchRolloutEngine(Qwen3Decoder.random(SHAPE, seed=5)).generate(p, params, sched)
    for a, b, f in zip(before.samples, after.samples, fresh.samples):
        assert not torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(b.response_ids, f.response_ids) and torch.equal(b.logprobs, f.logprobs)
    with pytest.raises(KeyError, match=r"model\.layers\.9"):
        engine.update_weights({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(3,\).*\(64,\)"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)})


def random_lora(rank: int = 4, alpha: float = 16.0) -> LoraAdapter:
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: (
            0.1 * torch.randn(rank, fan_in, generator=gen),
            0.1 * torch.randn(fan_out, rank, generator=gen),
        )
        for name, (fan_in, fan_out) in linear_in_out(SHAPE).items()
    }
    return LoraAdapter.from_alpha(weights, alpha)


def test_lora_changes_outputs_and_removal_restores_bit_exactly(hf_dir: Path) -> None:
    engine = TorchRolloutEngine.from_hf_dir(hf_dir)
    p, params, sched = (
        prompts([14, 3]),
        SamplingParams(max_new_tokens=12, seed=6),
        BudgetSchedule.from_preset("fixed:16"),
    )
    base = engine.generate(p, params, sched)
    adapter = random_lora()
    engine.set_lora(adapter)
    with_lora = engine.generate(p, params, sched)
    scored = engine.score([torch.cat([s.prompt_ids, s.response_ids]).tolist() for s in with_lora.samples])
    engine.set_lora(None)
    restored = engine.generate(p, params, sched)
    for b, w, r in zip(base.samples, with_lora.samples, restored.samples):
        assert not torch.equal(b.logprobs, w.logprobs)
        assert torch.equal(b.response_ids, r.response_ids) and torch.equal(b.logprobs, r.logprobs)
    # score() is the dense policy: never uses the adapter
    plain = engine.score([torch.cat([s.prompt_ids, s.response_ids]).tolist() for s in with_lora.samples])
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(scored, plain))
    # the adapter equals merging W + scaling * B @ A into a copy of the weights
    merged = dict(engine.model.params)
    for name, (a, b) in adapter.weights.items():
        merged[name + ".weight"] = merged[name + ".weight"] + adapter.scaling * b @ a
    ref = TorchRolloutEngine(Qwen3Decoder(SHAPE, merged)).generate(p, params, sched)
    for w, m in zip(with_lora.samples, ref.samples):
        assert torch.equal(w.response_ids, m.response_ids) and (w.logprobs - m.logprobs).abs().max() < 1e-5


def test_lora_validation_names_module_and_shapes(engine: TorchRolloutEngine) -> None:
    a = torch.zeros(2, 64)
    with pytest.raises(KeyError, match="lm_head"):
        engine.set_lora(LoraAdapter({"lm_head": (a, torch.zeros(96, 2))}, 1.0))
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.self_attn\.k_proj.*expected A \[r, 64\] and B \[32, r\]"
    ):
        engine.set_lora(LoraAdapter({"model.layers.0.self_attn.k_proj": (a, torch.zeros(64, 2))}, 1.0))


def test_sleep_releases_weights_and_cache_and_a_refit_restores_generation(hf_dir: Path) -> None:
    engine = TorchRolloutEngine.from_hf_dir(hf_dir)
    saved = {name: t.clone() for name, t in engine.model.params.items()}
    p, params, sched = (
        prompts([20, 7]),
        SamplingParams(max_new_tokens=10, seed=1),
        BudgetSchedule.from_preset("fixed:16"),
    )
    before = engine.generate(p, params, sched)
    weights = engine.model.weight_bytes
    assert engine.cache_bytes > 0 and weights >= sum(t.numel() * 4 for t in saved.values())
    engine.sleep()
    assert engine.cache_bytes == 0 and engine.model.weight_bytes == 0  # nothing kept, not even on the host
    with pytest.raises(RuntimeError, match="wake"):
        engine.generate(p, params, sched)
    engine.wake()
    assert engine.model.weight_bytes == weights
    with pytest.raises(RuntimeError, match="not refitted since wake"):
        engine.generate(p, params, sched)
    engine.update_weights({k: v for k, v in saved.items() if "layers.0." in k})
    with pytest.raises(RuntimeError, match="update_weights"):  # a partial refit is not enough
        engine.score([p[0]])
    engine.update_weights(saved)
    after = engine.generate(p, params, sched)
    for a, b in zip(before.samples, after.samples):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)


def test_engine_satisfies_the_protocol(engine: TorchRolloutEngine) -> None:
    assert isinstance(engine, RolloutEngine)
    batch = engine.generate(prompts([3]), greedy(5), DENSE)
    assert batch.num_response_tokens == 5 and batch.tokens_per_second() > 0


def test_backend_choice_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    from sparrow_nemo.rollout.torch.paged_attention import choose_backend

    with caplog.at_level(logging.INFO, logger="sparrow_nemo.rollout.torch.paged_attention"):
        assert choose_backend("auto", torch.device("meta")) == "torch"
        assert choose_backend("auto", torch.device("meta")) == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "rollout decode attention on meta: torch (no fused decode on meta)"
    ]


def test_bf16_engine_tracks_fp32(hf_dir: Path) -> None:
    """The dtype path a GPU uses (bf16 weights, cache and centroids; fp32 softmax/logits) on CPU."""
    p, params = prompts([40, 11]), greedy(12)
    sched = BudgetSchedule(bin_tokens=48, budgets=(32, 48), name="t")
    fp32 = TorchRolloutEngine.from_hf_dir(hf_dir, dense_layers=1)
    bf16 = TorchRolloutEngine.from_hf_dir(hf_dir, dtype=torch.bfloat16, dense_layers=1)
    assert bf16._pool(1).centroids[0].dtype == torch.bfloat16  # centroids follow the K dtype
    dense = bf16.generate(p, params, DENSE)
    scored = fp32.score([torch.cat([s.prompt_ids, s.response_ids]).tolist() for s in dense.samples])
    for s, d in zip(dense.samples, scored):
        assert s.logprobs.dtype == torch.float32 and s.response_ids.dtype == torch.int64
        assert (s.logprobs - d.logprobs[s.prompt_ids.numel() - 1 :]).abs().max() < 0.05  # bf16 rounding
    sparse, ref = bf16.generate(p, params, sched), fp32.generate(p, params, sched)
    assert [s.kv_budget.tolist() for s in sparse.samples] == [s.kv_budget.tolist() for s in ref.samples]
    assert torch.equal(sparse.samples[0].response_ids[:3], ref.samples[0].response_ids[:3])
