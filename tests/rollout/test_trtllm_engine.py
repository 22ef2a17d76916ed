"""The TensorRT-LLM engine without TensorRT-LLM: constructor kwargs, sampling translation, output and score
mapping, the size guard of score(), and the start-up check of the installed build.

Kwargs are checked against the TorchLlmArgs / KvCacheConfig / SamplingParams fields read in the sources
(``trtllm_sources``). The output mapping is checked against the torch rollout engine: its samples and scores
are written out the way TensorRT-LLM returns them (top-K with ranks 1..K, plus the sampled or target token
as an extra entry of rank > K when it is outside; plain dataclasses, the only test double, at the
TensorRT-LLM boundary) and mapped back; every field must come back equal. The engine itself runs only
where TensorRT-LLM and a GPU are present (the last test skips otherwise).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
import torch

from sparrow_nemo._optional import MissingOptionalDependency, is_available
from sparrow_nemo.grpo import setup
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.rollout.engine import RolloutSample, SamplingParams
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.trtllm.engine import (
    SCORE_LOGITS_LIMIT_BYTES,
    TRTLLM_VERSION,
    TrtllmRolloutEngine,
    check_score_size,
    llm_kwargs,
    sampling_kwargs,
    to_rollout_sample,
    to_scored_sequence,
)
from sparrow_nemo.rollout.trtllm.runtime import TrtllmRuntime, TrtllmVersionError, check_runtime
from sparrow_nemo.rollout.trtllm.sparse import SparrowSparseSpec
from sparrow_nemo.sparse.schedule import BudgetSchedule

from . import trtllm_sources as src
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


def _position(ids: list[int], lps: list[float], token: int, token_lp: float) -> dict[int, Logprob]:
    """One position as TensorRT-LLM's TorchSampler writes it: top-K ranked 1..K, then the token if absent."""
    d = {i: Logprob(p, r + 1) for r, (i, p) in enumerate(zip(ids, lps))}
    if token not in d:
        d[token] = Logprob(token_lp, len(ids) + 1)
    return d


def _as_trtllm(sample: RolloutSample) -> Completion:
    entries = [
        _position(ids, lps, tok, lp)
        for tok, lp, ids, lps in zip(
            sample.response_ids.tolist(),
            sample.logprobs.tolist(),
            sample.top_ids.tolist(),
            sample.top_logprobs.tolist(),
        )
    ]
    finish = {"length": "length", "stop_token": "stop", "stop_string": "stop"}[sample.finish_reason]
    return Completion(sample.response_ids.tolist(), entries, finish, sample.stop)


def test_import_without_trtllm_and_clear_error() -> None:
    module = importlib.import_module("sparrow_nemo.rollout.trtllm.engine")
    assert module.TRTLLM_VERSION == TRTLLM_VERSION == "1.2.0"
    if is_available("tensorrt_llm"):
        pytest.skip("tensorrt_llm is installed here")
    spec = SparrowSparseSpec(BudgetSchedule.from_preset("fixed:64"))
    with pytest.raises(MissingOptionalDependency, match=r"sparrow-nemo\[cluster\]"):
        TrtllmRolloutEngine(SHAPE, spec, {"model": "x"})


def test_the_recipe_reader_reaches_the_engine_with_a_clear_error(hf_dir) -> None:
    """``setup.trtllm_engine`` reads the recipe's sections (rollout, sparsity, data, model, distill) and starts the
    engine; without TensorRT-LLM that is the one-line missing-extra error, after every section was read."""
    if is_available("tensorrt_llm"):
        pytest.skip("tensorrt_llm is installed here")
    config = load_config("tiny_cpu_distill", ["rollout.backend=torch", "trainer.device=cpu"])
    with pytest.raises(MissingOptionalDependency, match=r"sparrow-nemo\[cluster\]"):
        setup.trtllm_engine(config, hf_dir)


def test_llm_kwargs_are_torch_llm_args_fields() -> None:
    config = load_config("qwen3_1p7b_math", ["rollout.backend=torch", "trainer.device=cpu"])
    spec = SparrowSparseSpec.from_sparsity(config.sparsity)
    kw = llm_kwargs(config.rollout, "/ckpt", spec, config.data.max_prompt_tokens, config.model.dtype)
    # BaseLlmArgs forbids extra fields: every key must be a TorchLlmArgs field of the sources
    assert set(kw) <= src.TORCH_LLM_ARGS_FIELDS, sorted(set(kw) - src.TORCH_LLM_ARGS_FIELDS)
    assert set(kw["kv_cache_config"]) <= src.KV_CACHE_CONFIG_FIELDS
    assert "enable_sleep_mode" not in kw and kw["enable_sleep"] is True
    assert kw["sampler_type"] in src.SAMPLER_TYPES and kw["sampler_type"] == "TorchSampler"
    assert kw["orchestrator_type"] in src.ORCHESTRATOR_TYPES and kw["orchestrator_type"] == "ray"
    assert kw["ray_worker_extension_cls"].endswith("trtllm.plugin.SparrowWorkerExtension")
    assert kw["attn_backend"] == "TRTLLM"  # the backend whose TrtllmAttention the plugin subclasses
    assert kw["model"] == "/ckpt" and kw["tensor_parallel_size"] == 1  # one engine per GPU
    assert kw["kv_cache_config"]["tokens_per_block"] == spec.page_size == config.sparsity.page_size
    assert kw["kv_cache_config"]["enable_block_reuse"] is False and kw["enable_chunked_prefill"] is False
    assert kw["max_num_tokens"] >= config.data.max_prompt_tokens  # a whole prompt fits one step
    assert SparrowSparseSpec.from_config_dict(kw["sparse_attention_config"]) == spec
    assert kw["max_seq_len"] == config.data.max_prompt_tokens + config.rollout.max_new_tokens
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
    for kwargs in (kw, greedy, none, own):
        assert set(kwargs) <= src.SAMPLING_PARAMS_FIELDS, sorted(set(kwargs) - src.SAMPLING_PARAMS_FIELDS)


@pytest.fixture(scope="module")
def torch_engine() -> TorchRolloutEngine:
    return TorchRolloutEngine.from_shape(SHAPE, seed=4, dense_layers=2)


def test_output_mapping_matches_torch_engine_samples(torch_engine: TorchRolloutEngine) -> None:
    schedule = BudgetSchedule(bin_tokens=16, budgets=(64, 80), page_size=16, name="t")
    prompts = [[1, 2, 3, 4, 5] * 4, [7, 8, 9]]
    eos = SHAPE.eos_token_id
    free = torch_engine.generate(
        prompts, SamplingParams(max_new_tokens=40, seed=1, stop_token_ids=()), schedule
    )
    stop_at = int(free.samples[0].response_ids[30])  # same seed: sample 0 stops on this token, by position 30
    reasons, outside = set(), 0
    for sampling in (
        SamplingParams(max_new_tokens=40, seed=1, logprobs_topk=5, stop_token_ids=(stop_at,)),
        SamplingParams(max_new_tokens=6, seed=2, logprobs_topk=3),
    ):
        batch = torch_engine.generate(prompts, sampling, schedule)
        stop_ids = (eos,) if sampling.stop_token_ids is None else sampling.stop_token_ids
        for prompt, sample in zip(prompts, batch.samples):
            outside += int((sample.top_ids != sample.response_ids[:, None]).all(dim=1).sum())
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
    assert outside > 0  # some sampled tokens were outside the top-K: the extra-entry path ran


def test_sampled_token_outside_the_topk() -> None:
    schedule = BudgetSchedule.dense()
    # top-2 ranked 1, 2; the sampled token 9 is outside them (its rank 7), as TorchSampler adds it
    pos = {5: Logprob(-0.1, 1), 6: Logprob(-2.5, 2), 9: Logprob(-4.0, 7)}
    got = to_rollout_sample([1], Completion([9], [pos], "length"), 2, schedule, (0,))
    assert got.logprobs.tolist() == [-4.0] and got.top_ids.tolist() == [[5, 6]]
    assert torch.equal(got.top_logprobs, torch.tensor([[-0.1, -2.5]]))
    # a tie at the K-th logprob: the ranks, not the ids, keep the extra entry out of the top-K
    tie = {5: Logprob(-0.1, 1), 6: Logprob(-2.5, 2), 3: Logprob(-2.5, 3)}
    assert to_rollout_sample([1], Completion([3], [tie], "length"), 2, schedule, (0,)).top_ids.tolist() == [
        [5, 6]
    ]
    with pytest.raises(ValueError, match="token 0: TensorRT-LLM returned no logprob for token 9"):
        to_rollout_sample(
            [1], Completion([9], [{5: Logprob(-0.1, 1), 6: Logprob(-2.5, 2)}], "length"), 2, schedule, (0,)
        )


def test_output_mapping_stop_string_and_errors() -> None:
    schedule = BudgetSchedule.dense()
    entries = [{5: Logprob(-0.1, 1), 6: Logprob(-2.5, 2)}, {6: Logprob(-0.2, 1), 5: Logprob(-1.9, 2)}]
    done = to_rollout_sample([1, 2], Completion([5, 6], entries, "stop", "</b>"), 2, schedule, (9,))
    assert (done.finish_reason, done.stop) == ("stop_string", "</b>")
    assert done.top_ids.tolist() == [[5, 6], [6, 5]] and done.cached_len.tolist() == [2, 3]
    with pytest.raises(ValueError, match="fewer than logprobs_topk=3"):
        to_rollout_sample([1], Completion([5], entries[:1], "length"), 3, schedule, (9,))
    with pytest.raises(ValueError, match="finish_reason='cancelled'"):
        to_rollout_sample([1], Completion([5], entries[:1], "cancelled"), 1, schedule, (9,))
    with pytest.raises(ValueError, match="has None logprob entries for 1 tokens"):
        to_rollout_sample([1], Completion([5], None, "length"), 1, schedule, (9,))


def test_score_mapping_matches_torch_engine_scores(torch_engine: TorchRolloutEngine) -> None:
    seqs = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7]]
    k = 2
    outside = 0
    for seq, scored in zip(seqs, torch_engine.score(seqs, topk=k)):
        # TensorRT-LLM: one entry per prompt token, row t predicting token t + 1; the last row predicts the
        # first generated token (here 0, not part of the sequence) and must be dropped
        prompt_lp = [
            _position(
                scored.top_ids[t].tolist(),
                scored.top_logprobs[t].tolist(),
                seq[t + 1],
                float(scored.logprobs[t]),
            )
            for t in range(len(seq) - 1)
        ]
        prompt_lp.append({0: Logprob(-0.01, 1), 11: Logprob(-5.0, 2)})
        outside += sum(seq[t + 1] not in scored.top_ids[t].tolist() for t in range(len(seq) - 1))
        back = to_scored_sequence(seq, prompt_lp, k)
        assert torch.equal(back.logprobs, scored.logprobs)
        assert torch.equal(back.top_ids, scored.top_ids) and torch.equal(
            back.top_logprobs, scored.top_logprobs
        )
    assert outside > 0  # target tokens outside the top-2 were scored through their extra entry


def test_score_offset_first_and_last_entries() -> None:
    ids = [3, 1, 4]
    prompt_lp = [
        {1: Logprob(-0.5, 1), 7: Logprob(-1.0, 2)},  # row 0 predicts ids[1] = 1 (in the top-2)
        {9: Logprob(-0.2, 1), 8: Logprob(-2.0, 2), 4: Logprob(-3.0, 5)},  # row 1: ids[2] = 4, outside
        {2: Logprob(-0.3, 1), 5: Logprob(-0.9, 2)},  # row 2 predicts the generated token: dropped
    ]
    got = to_scored_sequence(ids, prompt_lp, 2)
    assert torch.equal(got.logprobs, torch.tensor([-0.5, -3.0]))
    assert got.top_ids.tolist() == [[1, 7], [9, 8]]
    assert torch.equal(got.top_logprobs, torch.tensor([[-0.5, -1.0], [-0.2, -2.0]]))
    with pytest.raises(ValueError, match="2 entries for a prompt of 3 tokens"):
        to_scored_sequence(ids, prompt_lp[:2], 2)
    with pytest.raises(ValueError, match="position 2: TensorRT-LLM returned no logprob for token 4"):
        to_scored_sequence(ids, [prompt_lp[0], {9: Logprob(-0.2, 1), 8: Logprob(-2.0, 2)}, prompt_lp[2]], 2)


def test_score_size_guard() -> None:
    check_score_size([100, 8192], vocab_size=1000, max_num_tokens=8192)
    with pytest.raises(ValueError, match="sequence 1 has 8193 tokens, more than one TensorRT-LLM step"):
        check_score_size([10, 8193], vocab_size=1000, max_num_tokens=8192)
    # recipe scale: a 37K-token response with Qwen3's vocabulary is ~21 GiB of fp32 context logits
    tokens = 37888
    assert tokens * 151936 * 4 > SCORE_LOGITS_LIMIT_BYTES
    with pytest.raises(ValueError, match=r"sequence 0 \(37888 tokens\) needs 21\.4 GiB"):
        check_score_size([tokens], vocab_size=151936, max_num_tokens=40960)


def _runtime(**changes: object) -> TrtllmRuntime:
    base = {
        "version": TRTLLM_VERSION,
        "logprob_state_fields": src.LOGPROB_STATE_WITH_SAMPLED,
        "llm_args_fields": src.TORCH_LLM_ARGS_FIELDS,
    }
    return TrtllmRuntime(**{**base, **changes})


def test_startup_check_of_the_installed_build() -> None:
    check_runtime(_runtime())  # the sources read: passes
    with pytest.raises(
        TrtllmVersionError, match=r"version 1\.3\.0rc7 is installed, the adapter was written for 1\.2\.0"
    ):
        check_runtime(_runtime(version="1.3.0rc7"))
    with pytest.raises(TrtllmVersionError, match="does not return the sampled token's logprob"):
        check_runtime(_runtime(logprob_state_fields=src.LOGPROB_STATE_TOPK_ONLY))
    with pytest.raises(TrtllmVersionError, match=r"TorchLlmArgs has no field\(s\) \['enable_sleep'\]"):
        check_runtime(_runtime(llm_args_fields=src.TORCH_LLM_ARGS_FIELDS - {"enable_sleep"}))


@pytest.mark.skipif(
    not (is_available("tensorrt_llm") and torch.cuda.is_available()),
    reason="needs tensorrt_llm (extra 'cluster') and a CUDA GPU; not run in this repository's CI",
)
def test_engine_generates_with_the_sparrow_algorithm(hf_dir) -> None:  # pragma: no cover - GPU only
    config = load_config(
        "tiny_cpu_short", ["model.dtype=bf16", "rollout.max_batch_size=4", "rollout.max_new_tokens=48"]
    )
    engine = setup.trtllm_engine(config, hf_dir)
    schedule = BudgetSchedule(bin_tokens=32, budgets=(64,), page_size=16, name="t")
    sampling = SamplingParams(max_new_tokens=48, seed=0, stop_token_ids=())
    batch = engine.generate([[1, 2, 3] * 30, [4, 5] * 20], sampling, schedule)
    assert [s.response_ids.numel() for s in batch.samples] == [48, 48]
    assert batch.samples[0].kv_budget[1:].eq(64).all()
    engine.sleep()
    engine.wake()
    assert len(engine.score([[1, 2, 3, 4]], topk=5)[0].logprobs) == 3
