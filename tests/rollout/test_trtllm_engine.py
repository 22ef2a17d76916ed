"""The TensorRT-LLM engine without TensorRT-LLM: lazy import, LLM kwargs, sampling translation, output mapping.

The output mapping is checked against the torch rollout engine: its samples / scores are written out as
TensorRT-LLM-shaped completions (plain dataclasses, the only test double, at the TensorRT-LLM boundary)
and mapped back; every field must come back equal. The engine itself runs only where TensorRT-LLM and
a GPU are present (the last test skips otherwise).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch

from sparrow_nemo._optional import MissingOptionalDependency, is_available
from sparrow_nemo.config import load_config
from sparrow_nemo.rollout.engine import RolloutSample, SamplingParams
from sparrow_nemo.rollout.torch_engine import TorchRolloutEngine
from sparrow_nemo.rollout.trtllm import (
    TRTLLM_VERSION,
    TrtllmRolloutEngine,
    llm_kwargs,
    sampling_kwargs,
    to_rollout_sample,
    to_scored_sequence,
)
from sparrow_nemo.rollout.trtllm_sparse import SparrowSparseSpec
from sparrow_nemo.sparse.schedule import BudgetSchedule

from ._helpers import SHAPE


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


def _as_trtllm(sample: RolloutSample) -> Completion:
    """A reference sample written the way TensorRT-LLM returns it: top-K dict (+ the sampled id)."""
    entries = []
    for tok, lp, ids, lps in zip(
        sample.response_ids.tolist(),
        sample.logprobs.tolist(),
        sample.top_ids.tolist(),
        sample.top_logprobs.tolist(),
    ):
        d = {i: Logprob(p, r + 1) for r, (i, p) in enumerate(zip(ids, lps))}
        d.setdefault(tok, Logprob(lp))
        entries.append(d)
    finish = {"length": "length", "stop_token": "stop", "stop_string": "stop"}[sample.finish_reason]
    return Completion(sample.response_ids.tolist(), entries, finish, sample.stop)


def test_import_without_trtllm_and_clear_error() -> None:
    module = importlib.import_module("sparrow_nemo.rollout.trtllm")
    assert module.TRTLLM_VERSION == TRTLLM_VERSION == "1.2.0"
    if is_available("tensorrt_llm"):
        pytest.skip("tensorrt_llm is installed here")
    spec = SparrowSparseSpec(BudgetSchedule.from_preset("fixed:64"))
    with pytest.raises(MissingOptionalDependency, match=r"sparrow-nemo\[cluster\]"):
        TrtllmRolloutEngine(SHAPE, spec, {"model": "x"})


def test_llm_kwargs_from_recipe() -> None:
    config = load_config("qwen3_1p7b_math", ["rollout.backend=torch", "trainer.device=cpu"])
    spec = SparrowSparseSpec.from_recipe(config)
    kw = llm_kwargs(config, "/ckpt", spec)
    assert kw["model"] == "/ckpt" and kw["backend"] == "pytorch"
    assert kw["kv_cache_config"]["tokens_per_block"] == spec.page_size == config.sparsity.page_size
    assert kw["kv_cache_config"]["enable_block_reuse"] is False and kw["enable_chunked_prefill"] is False
    assert SparrowSparseSpec.from_config_dict(kw["sparse_attention_config"]) == spec
    assert kw["sparse_attention_config"]["dense_layers"] == config.sparsity.dense_layers
    assert kw["max_seq_len"] == config.data.max_prompt_tokens + config.rollout.max_new_tokens
    assert kw["tensor_parallel_size"] == config.policy.tensor_model_parallel_size
    assert kw["ray_worker_extension_cls"].endswith("trtllm_plugin.SparrowWorkerExtension")
    assert kw["dtype"] == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[config.model.dtype]


def test_sampling_kwargs() -> None:
    base = SamplingParams(max_new_tokens=7, temperature=1.0, top_p=0.9, top_k=0, logprobs_topk=20)
    kw = sampling_kwargs(base, seed=5, eos_token_id=99)
    assert kw == {
        "max_tokens": 7,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": None,
        "seed": 5,
        "logprobs": 20,
        "stop": None,
        "include_stop_str_in_output": True,
        "stop_token_ids": [99],
    }
    greedy = sampling_kwargs(SamplingParams(temperature=0.0, top_k=5), 0, 99)
    assert greedy["top_k"] == 1 and greedy["temperature"] == 1.0
    none = sampling_kwargs(SamplingParams(stop_token_ids=(), stop_strings=("</a>",)), 0, 99)
    assert none["ignore_eos"] is True and "stop_token_ids" not in none and none["stop"] == ["</a>"]
    own = sampling_kwargs(SamplingParams(stop_token_ids=(3, 4)), 0, 99)
    assert own["stop_token_ids"] == [3, 4] and own["ignore_eos"] is True
    assert sampling_kwargs(SamplingParams(stop_token_ids=(99,)), 0, 99)["ignore_eos"] is False


@pytest.fixture(scope="module")
def reference() -> TorchRolloutEngine:
    return TorchRolloutEngine.from_shape(SHAPE, seed=4, dense_layers=2)


def test_output_mapping_matches_reference_samples(reference: TorchRolloutEngine) -> None:
    schedule = BudgetSchedule(bin_tokens=16, budgets=(64, 80), page_size=16, name="t")
    prompts = [[1, 2, 3, 4, 5] * 4, [7, 8, 9]]
    eos = SHAPE.eos_token_id
    free = reference.generate(prompts, SamplingParams(max_new_tokens=40, seed=1, stop_token_ids=()), schedule)
    stop_at = int(free.samples[0].response_ids[30])  # same seed: sample 0 stops on this token, by position 30
    reasons = set()
    for sampling in (
        SamplingParams(max_new_tokens=40, seed=1, logprobs_topk=5, stop_token_ids=(stop_at,)),
        SamplingParams(max_new_tokens=6, seed=2, logprobs_topk=3),
    ):
        batch = reference.generate(prompts, sampling, schedule)
        stop_ids = (eos,) if sampling.stop_token_ids is None else sampling.stop_token_ids
        for prompt, sample in zip(prompts, batch.samples):
            back = to_rollout_sample(prompt, _as_trtllm(sample), sampling.logprobs_topk, schedule, stop_ids)
            for name in (
                "prompt_ids",
                "response_ids",
                "logprobs",
                "top_ids",
                "top_logprobs",
                "cached_len",
                "kv_budget",
            ):
                assert torch.equal(getattr(back, name), getattr(sample, name)), name
            assert (back.finish_reason, back.stop) == (sample.finish_reason, sample.stop)
            reasons.add(sample.finish_reason)
    assert reasons == {"stop_token", "length"}


def test_output_mapping_stop_string_and_errors() -> None:
    schedule = BudgetSchedule.dense()
    entries = [{5: Logprob(-0.1), 6: Logprob(-2.5)}, {6: Logprob(-0.2), 5: Logprob(-1.9)}]
    done = to_rollout_sample([1, 2], Completion([5, 6], entries, "stop", "</b>"), 2, schedule, (9,))
    assert (done.finish_reason, done.stop) == ("stop_string", "</b>")
    assert done.top_ids.tolist() == [[5, 6], [6, 5]] and done.cached_len.tolist() == [2, 3]
    with pytest.raises(ValueError, match="sampled id 7 is missing"):
        to_rollout_sample([1], Completion([7], [{5: Logprob(-1.0)}], "length"), 1, schedule, (9,))
    with pytest.raises(ValueError, match="fewer than logprobs_topk=3"):
        to_rollout_sample([1], Completion([5], entries[:1], "length"), 3, schedule, (9,))
    with pytest.raises(ValueError, match="finish_reason='cancelled'"):
        to_rollout_sample([1], Completion([5], entries[:1], "cancelled"), 1, schedule, (9,))
    with pytest.raises(ValueError, match="has None logprob entries for 1 tokens"):
        to_rollout_sample([1], Completion([5], None, "length"), 1, schedule, (9,))


def test_score_mapping_matches_reference_scores(reference: TorchRolloutEngine) -> None:
    seqs = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]]
    k = 4
    for seq, scored in zip(seqs, reference.score(seqs, topk=k)):
        prompt_lp: list[dict[int, Logprob] | None] = [None]
        for t in range(len(seq) - 1):
            d = {i: Logprob(p) for i, p in zip(scored.top_ids[t].tolist(), scored.top_logprobs[t].tolist())}
            d.setdefault(seq[t + 1], Logprob(float(scored.logprobs[t])))
            prompt_lp.append(d)
        back = to_scored_sequence(seq, prompt_lp, k)
        assert torch.equal(back.logprobs, scored.logprobs)
        assert torch.equal(back.top_ids, scored.top_ids) and torch.equal(
            back.top_logprobs, scored.top_logprobs
        )
        assert torch.equal(to_scored_sequence(seq, prompt_lp[1:], k).logprobs, scored.logprobs)
    with pytest.raises(ValueError, match="3 entries for a sequence of 5 tokens"):
        to_scored_sequence([1, 2, 3, 4, 5], [None, {}, {}], 1)


@pytest.mark.skipif(
    not (is_available("tensorrt_llm") and torch.cuda.is_available()),
    reason="needs tensorrt_llm (extra 'cluster') and a CUDA GPU; not run in this repository's CI",
)
def test_engine_generates_with_the_sparrow_algorithm(hf_dir) -> None:  # pragma: no cover - GPU only
    config = load_config(None, ["model.dtype=bf16", "rollout.max_batch_size=4", "rollout.max_new_tokens=48"])
    engine = TrtllmRolloutEngine.from_recipe(config, hf_dir)
    schedule = BudgetSchedule(bin_tokens=32, budgets=(64,), page_size=16, name="t")
    sampling = SamplingParams(max_new_tokens=48, seed=0, stop_token_ids=())
    batch = engine.generate([[1, 2, 3] * 30, [4, 5] * 20], sampling, schedule)
    assert [s.response_ids.numel() for s in batch.samples] == [48, 48]
    assert batch.samples[0].kv_budget[1:].eq(64).all()
    engine.sleep()
    engine.wake()
    assert len(engine.score([[1, 2, 3, 4]], topk=5)[0].logprobs) == 3
