"""The TensorRT-LLM rollout engine (``rollout.backend: trtllm``; extra ``cluster``, tensorrt-llm 1.2.0).

Never run: TensorRT-LLM cannot be installed where this repository is tested. Everything below that needs
no TensorRT-LLM (constructor kwargs, sampling translation, output mapping, refit messages) is a plain
function tested on CPU against the field lists and behaviour read in its sources (README, TensorRT-LLM
section). :class:`TrtllmRolloutEngine` implements :class:`~sparrow_nemo.rollout.engine.RolloutEngine`
over ``tensorrt_llm.LLM`` (PyTorch backend) with Sparrow's sparse attention registered as the
``sparse_attention_config`` algorithm "sparrow" (:mod:`sparrow_nemo.rollout.trtllm.plugin`):

- one engine per GPU, colocated with that GPU's policy rank (:mod:`~sparrow_nemo.rollout.trtllm.placement`);
  refit from that rank by its own device UUID (:func:`~sparrow_nemo.rollout.trtllm.weights.refit_messages`),
  sleep/wake around rollout (TensorRT-LLM's sleep feature, ``enable_sleep``);
- generation: one request per prompt, ``logprobs=K``; :func:`to_rollout_sample` maps outputs, the
  sampled token's logprob included when it is outside the top-K;
- :meth:`TrtllmRolloutEngine.score`: prompt logprobs of a 1-token request, :func:`to_scored_sequence`
  (context-logit row t predicts token t + 1);
- schedule: pushed to every worker before a call (``set_sparrow_schedule``);
- LoRA (DistillSparse): merged into the linears it targets; ``score`` swaps the base weights in.

Per-sample seeds: TensorRT-LLM's TorchSampler draws every request from one engine-wide generator
(``tensorrt_llm/_torch/pyexecutor/sampler.py`` ``TorchSampler.get_generator``: one ``torch.Generator``
seeded with ``_global_seed``); the per-request ``SamplingParams.seed`` is passed but not used by it. So a
sample depends on the whole batch, not only on its own seed: the engine re-seeds that generator before
every call from the call's seeds (reproducible for the same batch, distinct across engines and steps)
and warns once that a part of a batch does not reproduce its samples in the whole batch.

Logprob convention: TensorRT-LLM returns raw logprobs (temperature 1, before top-k/top-p: the
``LogprobMode.RAW`` default), this project's convention; the engine warns when sampling filters.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from sparrow_nemo._optional import require
from sparrow_nemo.hf_qwen3 import LoraAdapter
from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.rollout.engine import (
    RolloutBatch,
    RolloutConfig,
    RolloutSample,
    SamplingParams,
    ScoredSequence,
    TokenProgress,
)
from sparrow_nemo.rollout.sampling import batch_seeds, sample_seed
from sparrow_nemo.rollout.trtllm.placement import engine_env, patched_env
from sparrow_nemo.rollout.trtllm.runtime import TRTLLM_VERSION, check_runtime, probe_runtime
from sparrow_nemo.rollout.trtllm.sparse import SparrowSparseSpec
from sparrow_nemo.rollout.trtllm.weights import (
    check_handles,
    merge_lora,
    refit_messages,
    refit_tensors,
)
from sparrow_nemo.sparse.config import SparsityConfig
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

__all__ = ["TRTLLM_VERSION", "TrtllmRolloutEngine", "llm_kwargs", "sampling_kwargs"]

log = logging.getLogger(__name__)

#: memory tags released by sleep() / taken back by wake() (``tensorrt_llm/_torch/virtual_memory.py``
#: ``ExecutorMemoryType`` values; the KV cache, and the page landmarks its manager owns, come back empty)
SLEEP_TAGS = ("model", "kv_cache", "executor_extra", "model_extra", "sampler")
#: bytes per IPC weight bucket
REFIT_BUCKET_BYTES = 1 << 30
#: tokens per forward step; TorchLlmArgs ``max_num_tokens`` default (``tensorrt_llm/llmapi/llm_args.py``)
MAX_NUM_TOKENS = 8192
#: fraction of the free GPU memory (after the colocated policy is built) the KV cache may take
KV_CACHE_FREE_FRACTION = 0.85
#: largest context-logits tensor score() lets TensorRT-LLM build: prompt logprobs are computed from the
#: full [L, vocab] float32 context logits of the request (``tensorrt_llm/sampling_params.py``
#: ``_get_output_config``: prompt_logprobs switches ``return_context_logits`` on)
SCORE_LOGITS_LIMIT_BYTES = 8 << 30


class TokenLogprob(Protocol):
    """One entry of TensorRT-LLM's per-position logprob dict (``tensorrt_llm.executor.result.Logprob``)."""

    logprob: float
    rank: int | None


class CompletionLike(Protocol):
    """The fields of ``tensorrt_llm`` ``CompletionOutput`` this engine reads."""

    token_ids: list[int]
    logprobs: list[dict[int, TokenLogprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


def llm_kwargs(
    r: RolloutConfig,
    model_dir: str | Path,
    spec: SparrowSparseSpec,
    max_prompt_tokens: int,
    dtype: str,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """Keyword arguments of ``tensorrt_llm.LLM`` (TorchLlmArgs fields) for the recipe's ``rollout`` section, its
    sparse spec, ``data.max_prompt_tokens`` and ``model.dtype`` (fp32 / bf16 / fp16).

    ``sparse_attention_config`` is the spec's dict; the engine turns it into the plugin's config class.
    ``tensor_parallel_size`` is the engine's (1: one engine per GPU, colocated), not the policy's.
    """
    return {
        "model": str(model_dir),
        "tensor_parallel_size": tensor_parallel_size,
        "dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        "max_batch_size": r.max_batch_size,
        "max_seq_len": max_prompt_tokens + r.max_new_tokens,
        "max_num_tokens": max(MAX_NUM_TOKENS, max_prompt_tokens),  # a whole prompt per step
        "sparse_attention_config": spec.to_config_dict(),
        "kv_cache_config": {
            "enable_block_reuse": False,  # a reused block would carry no page landmark
            "tokens_per_block": spec.page_size,  # one page landmark per KV block
            "free_gpu_memory_fraction": KV_CACHE_FREE_FRACTION,
        },
        "enable_chunked_prefill": False,  # a prompt's page landmarks are written by one context step
        "attn_backend": "TRTLLM",
        "sampler_type": "TorchSampler",  # the sampler whose top-K logprobs this engine maps
        "cuda_graph_config": None,  # never captured yet (the prediction is capturable; not run)
        "enable_sleep": True,
        "orchestrator_type": "ray",  # ray_worker_extension_cls needs it (TorchLlmArgs validator)
        "ray_worker_extension_cls": "sparrow_nemo.rollout.trtllm.plugin.SparrowWorkerExtension",
    }


def sampling_kwargs(sampling: SamplingParams, seed: int, eos_token_id: int) -> dict[str, Any]:
    """Keyword arguments of ``tensorrt_llm.SamplingParams`` for one request of ``sampling``.

    ``seed`` is passed as the request's seed; TorchSampler does not use it (module docstring).
    """
    greedy = sampling.temperature == 0
    out: dict[str, Any] = {
        "max_tokens": sampling.max_new_tokens,
        "temperature": 1.0 if greedy else sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": 1 if greedy else (sampling.top_k or None),
        "seed": seed,
        "logprobs": sampling.logprobs_topk,
        "stop": list(sampling.stop_strings) or None,
        "include_stop_str_in_output": True,
    }
    if sampling.stop_token_ids is None:
        out["stop_token_ids"] = [eos_token_id]
    elif sampling.stop_token_ids:
        out["stop_token_ids"] = list(sampling.stop_token_ids)
        out["ignore_eos"] = eos_token_id not in sampling.stop_token_ids
    else:
        out["ignore_eos"] = True
    return out


def _rank_key(item: tuple[int, TokenLogprob]) -> tuple[float, float, int]:
    token, lp = item
    rank = getattr(lp, "rank", None)
    return (float(rank) if rank is not None else 0.0, -float(lp.logprob), token)


def _topk_entries(entries: Mapping[int, TokenLogprob], k: int, where: str) -> tuple[list[int], list[float]]:
    """The top-k (id, logprob) of a position, best first.

    TensorRT-LLM's dict holds the top-K with ranks 1..K and, past them, the sampled (or target) token
    when it is not among them (rank > K): ranks decide, so that entry never displaces a top-K one.
    """
    ranked = sorted(entries.items(), key=_rank_key)[:k]
    if len(ranked) < k or any(getattr(lp, "rank", None) not in (None, *range(1, k + 1)) for _, lp in ranked):
        raise ValueError(f"{where}: TensorRT-LLM returned fewer than logprobs_topk={k} top logprobs")
    return [i for i, _ in ranked], [float(lp.logprob) for _, lp in ranked]


def _token_logprob(entries: Mapping[int, TokenLogprob], token: int, where: str) -> float:
    if token not in entries:
        raise ValueError(
            f"{where}: TensorRT-LLM returned no logprob for token {token} (outside the top-K and not added; "
            "the TorchSampler this adapter needs adds it, see rollout/trtllm/runtime.py)"
        )
    return float(entries[token].logprob)


def to_rollout_sample(
    prompt_ids: Sequence[int],
    completion: CompletionLike,
    topk: int,
    schedule: BudgetSchedule,
    stop_token_ids: Sequence[int],
) -> RolloutSample:
    """One TensorRT-LLM completion -> :class:`RolloutSample` (same fields as the torch rollout engine's).

    Position i's dict holds the top-K and, when outside them, the sampled token (its rank > K): the
    sampled logprob comes from its entry either way, the top-K lists never include the extra one.
    ``cached_len`` of response token i is ``len(prompt) + i``; its KV budget is the schedule's at that
    length, except the first token, which comes from the dense prefill (``DENSE_BUDGET``).
    """
    ids = list(completion.token_ids)
    if not ids:
        raise ValueError("TensorRT-LLM completion has no tokens")
    if completion.logprobs is None or len(completion.logprobs) != len(ids):
        got = None if completion.logprobs is None else len(completion.logprobs)
        raise ValueError(f"TensorRT-LLM completion has {got} logprob entries for {len(ids)} tokens")
    sampled, top_ids, top_lp = [], [], []
    for i, (token, entries) in enumerate(zip(ids, completion.logprobs)):
        sampled.append(_token_logprob(entries, token, f"token {i}"))
        t_ids, t_lp = _topk_entries(entries, topk, f"token {i}")
        top_ids.append(t_ids)
        top_lp.append(t_lp)
    cached = torch.arange(len(ids), dtype=torch.int64) + len(prompt_ids)
    budget = schedule.budgets_for(cached)
    budget[0] = DENSE_BUDGET
    if completion.finish_reason == "length":
        reason, stop = "length", None
    elif completion.finish_reason == "stop" and isinstance(completion.stop_reason, str):
        reason, stop = "stop_string", completion.stop_reason
    elif completion.finish_reason == "stop" and ids[-1] in stop_token_ids:
        reason, stop = "stop_token", ids[-1]
    else:
        raise ValueError(
            f"TensorRT-LLM finish_reason={completion.finish_reason!r} (stop_reason={completion.stop_reason!r}) "
            "is not a stop token, stop string or length"
        )
    return RolloutSample(
        prompt_ids=torch.tensor(list(prompt_ids), dtype=torch.int64),
        response_ids=torch.tensor(ids, dtype=torch.int64),
        logprobs=torch.tensor(sampled, dtype=torch.float32),
        top_ids=torch.tensor(top_ids, dtype=torch.int64),
        top_logprobs=torch.tensor(top_lp, dtype=torch.float32),
        cached_len=cached,
        kv_budget=budget,
        finish_reason=reason,
        stop=stop,
    )


def to_scored_sequence(
    ids: Sequence[int], prompt_logprobs: Sequence[Mapping[int, TokenLogprob]], topk: int
) -> ScoredSequence:
    """TensorRT-LLM ``prompt_logprobs`` of a sequence sent as the prompt -> :class:`ScoredSequence`.

    TensorRT-LLM computes them from the context logits (``tensorrt_llm/executor/worker.py``
    ``_compute_pytorch_prompt_logprobs`` -> ``compute_logprobs``): one entry per prompt token, entry t from
    logit row t, the distribution of token t + 1; the last entry predicts the first *generated* token,
    which is not part of ``ids``, and is dropped. Entry t is scored at ``ids[t + 1]``; where that token is
    outside the top-K the dict carries it as an extra entry (builds that pass the prompt token ids to
    ``compute_logprobs``), which never enters the top-K lists; without it the position raises.
    """
    entries = list(prompt_logprobs)
    if len(entries) != len(ids):
        raise ValueError(
            f"prompt_logprobs has {len(entries)} entries for a prompt of {len(ids)} tokens (expected one "
            "per prompt token: row t predicts token t + 1)"
        )
    lp, top_ids, top_lp = [], [], []
    for t in range(len(ids) - 1):
        where = f"position {t + 1}"
        lp.append(_token_logprob(entries[t], ids[t + 1], where))
        i, p = _topk_entries(entries[t], topk, where)
        top_ids.append(i)
        top_lp.append(p)
    return ScoredSequence(
        logprobs=torch.tensor(lp, dtype=torch.float32),
        top_ids=torch.tensor(top_ids, dtype=torch.int64).view(-1, topk),
        top_logprobs=torch.tensor(top_lp, dtype=torch.float32).view(-1, topk),
    )


def check_score_size(lengths: Sequence[int], vocab_size: int, max_num_tokens: int) -> None:
    """Refuse a score() TensorRT-LLM could not run: a sequence longer than one step's tokens, or whose
    [L, vocab] float32 context logits exceed :data:`SCORE_LOGITS_LIMIT_BYTES` (one line naming it)."""
    for i, n in enumerate(lengths):
        if n > max_num_tokens:
            raise ValueError(
                f"score: sequence {i} has {n} tokens, more than one TensorRT-LLM step takes "
                f"(max_num_tokens={max_num_tokens}, no chunked prefill)"
            )
        nbytes = n * vocab_size * 4
        if nbytes > SCORE_LOGITS_LIMIT_BYTES:
            raise ValueError(
                f"score: sequence {i} ({n} tokens) needs {nbytes / 2**30:.1f} GiB of context logits, over "
                f"the {SCORE_LOGITS_LIMIT_BYTES / 2**30:.0f} GiB limit; score long sequences with the policy"
            )


class TrtllmRolloutEngine:
    """:class:`~sparrow_nemo.rollout.engine.RolloutEngine` over ``tensorrt_llm.LLM`` (see the module docstring).

    Built by each policy rank for its own GPU (engine tensor parallel 1).

    Args:
        shape: the model's :class:`Qwen3Shape` (refit checks). spec: the sparse settings and schedule.
        kwargs: ``tensorrt_llm.LLM`` keyword arguments (e.g. :func:`llm_kwargs`), ``model`` included.
        dtype: the engine's weight dtype (refit tensors are cast to it).
        lora_modules: HF linear names (``q_proj`` ...) a LoRA adapter may target; their base weights are
            kept on the host at each refit so that adapters can be merged and unmerged (none: no copy).
    """

    def __init__(
        self,
        shape: Qwen3Shape,
        spec: SparrowSparseSpec,
        kwargs: Mapping[str, Any],
        dtype: torch.dtype = torch.bfloat16,
        lora_modules: Sequence[str] = (),
    ) -> None:
        trtllm = require("tensorrt_llm")
        check_runtime(probe_runtime(trtllm))
        from sparrow_nemo.rollout.trtllm import plugin as trtllm_plugin

        if kwargs.get("tensor_parallel_size", 1) != 1:
            raise ValueError(
                "TrtllmRolloutEngine runs one engine per GPU (tensor_parallel_size=1); an engine over "
                "several GPUs needs their ranks' refit handles merged (trtllm_weights.merge_handles), "
                "which no caller does yet"
            )
        args = dict(kwargs)
        args["sparse_attention_config"] = trtllm_plugin.SparrowSparseAttentionConfig(**spec.to_config_dict())
        self._trtllm = trtllm
        self.shape = shape
        self.spec = spec
        self.dtype = dtype
        self.max_num_tokens = int(args.get("max_num_tokens", MAX_NUM_TOKENS))
        self._lora_suffixes = tuple(f".{m}.weight" for m in lora_modules)
        device = torch.cuda.current_device()
        with patched_env(engine_env(device, os.environ.get("CUDA_VISIBLE_DEVICES"))):
            self._llm = trtllm.LLM(**args)
        from tensorrt_llm._torch.utils import get_device_uuid

        self._device = torch.device("cuda", device)
        self._device_uuid = get_device_uuid(device)
        self._worker_uuids = list(self._llm._collective_rpc("sparrow_device_uuid"))
        if self._worker_uuids != [self._device_uuid]:
            raise RuntimeError(
                f"the TensorRT-LLM engine's worker runs on {self._worker_uuids}, this rank on "
                f"{self._device_uuid}: the engine is not colocated with its policy rank"
            )
        self._base: dict[str, torch.Tensor] = {}
        self._lora: LoraAdapter | None = None
        self._asleep = False
        self._warned_seeds = False

    @classmethod
    def start(
        cls,
        model_dir: str | Path,
        rollout: RolloutConfig,
        sparsity: SparsityConfig,
        max_prompt_tokens: int,
        dtype: str,
        lora_modules: Sequence[str] = (),
    ) -> TrtllmRolloutEngine:
        """The engine the recipe's ``rollout`` and ``sparsity`` sections describe, started from ``model_dir``
        (``max_prompt_tokens``: ``data.max_prompt_tokens``; ``dtype``: ``model.dtype``; ``lora_modules``: the
        DistillSparse adapter's ``distill.target_modules``, empty without one)."""
        from sparrow_nemo.hf_qwen3 import SafetensorsDir, resolve_dtype, shape_from_hf_config

        spec = SparrowSparseSpec.from_sparsity(sparsity)
        shape = shape_from_hf_config(SafetensorsDir(model_dir).config())
        kwargs = llm_kwargs(rollout, model_dir, spec, max_prompt_tokens, dtype, rollout.tensor_parallel_size)
        return cls(shape, spec, kwargs, resolve_dtype(dtype), lora_modules)

    # ----------------------------------------------------------------- RolloutEngine API
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        *,
        sample_seeds: Sequence[int] | None = None,
        on_tokens: TokenProgress | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt. Seeds: see the module docstring (one engine-wide generator,
        re-seeded per call). ``on_tokens`` hears the total once, when ``LLM.generate`` returns."""
        seeds = batch_seeds(sampling.seed, len(prompts), sample_seeds)
        self._check_awake()
        if sampling.temperature not in (0.0, 1.0) or sampling.top_k or sampling.top_p < 1.0:
            log.warning(
                "TensorRT-LLM returns raw logprobs; with temperature=%s top_k=%s top_p=%s they differ from the "
                "distribution sampled from (the rollout/train ratio assumes temperature 1, no filtering)",
                sampling.temperature,
                sampling.top_k,
                sampling.top_p,
            )
        if not self._warned_seeds:
            log.warning(
                "TensorRT-LLM's TorchSampler draws all requests from one generator: a sample depends on its "
                "whole batch, not only on its seed (re-seeded per call, so a batch reproduces)"
            )
            self._warned_seeds = True
        self._use_schedule(schedule)
        if seeds:
            self._llm._collective_rpc("sparrow_seed_sampler", args=(sample_seed(seeds[0], len(seeds)),))
        eos = self.shape.eos_token_id
        stop_ids = (eos,) if sampling.stop_token_ids is None else sampling.stop_token_ids
        params = [self._trtllm.SamplingParams(**sampling_kwargs(sampling, seed, eos)) for seed in seeds]
        t0 = time.perf_counter()
        outputs = self._llm.generate([list(p) for p in prompts], sampling_params=params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        samples = [
            to_rollout_sample(p, out.outputs[0], sampling.logprobs_topk, schedule, stop_ids)
            for p, out in zip(prompts, outputs)
        ]
        # TensorRT-LLM overlaps prefill and decode across requests: the wall time is reported as decode.
        batch = RolloutBatch(samples=samples, schedule_name=schedule.name, prefill_s=0.0, decode_s=elapsed)
        if on_tokens is not None:
            on_tokens(batch.num_response_tokens)
        return batch

    def score(self, sequences: Sequence[Sequence[int]], topk: int = 20) -> list[ScoredSequence]:
        """Dense teacher-forced scores (prompt logprobs of a 1-token request), without the LoRA adapter.

        Bounded by :func:`check_score_size`: TensorRT-LLM builds each request's [L, vocab] context logits.
        """
        self._check_awake()
        if not sequences:
            return []
        check_score_size([len(s) for s in sequences], self.shape.vocab_size, self.max_num_tokens)
        adapter = self._lora
        if adapter is not None:
            self.set_lora(None)
        try:
            params = self._trtllm.SamplingParams(max_tokens=1, prompt_logprobs=topk, logprobs=topk)
            outputs = self._llm.generate([list(s) for s in sequences], sampling_params=params, use_tqdm=False)
        finally:
            if adapter is not None:
                self.set_lora(adapter)
        return [
            to_scored_sequence(s, out.outputs[0].prompt_logprobs, topk) for s, out in zip(sequences, outputs)
        ]

    def update_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Refit from HF-named tensors (a subset is fine) of this rank's policy; an active adapter is
        re-merged on top. Only the linears an adapter may target are kept on the host."""
        self._check_awake()
        named = refit_tensors(state, self.shape, self.dtype)
        self._base.update({n: t.to("cpu", copy=True) for n, t in named if n.endswith(self._lora_suffixes)})
        if self._lora is not None:
            named = list({**dict(named), **merge_lora(self._base, self._lora, self.shape)}.items())
        self._push(named)

    def set_lora(self, adapter: LoraAdapter | None) -> None:
        """Merge ``adapter`` into the linears it targets (None restores the base weights of the last one)."""
        self._check_awake()
        if adapter is not None:
            untracked = sorted(m for m in adapter.weights if not f"{m}.weight".endswith(self._lora_suffixes))
            if untracked:
                raise ValueError(
                    f"set_lora: the engine keeps no base weights for {untracked[:3]}; build it with "
                    "lora_modules naming them (distill.target_modules)"
                )
        previous, self._lora = self._lora, adapter
        names = set() if previous is None else {f"{m}.weight" for m in previous.weights}
        merged = {} if adapter is None else merge_lora(self._base, adapter, self.shape)
        restore = {n: self._base[n] for n in names - set(merged)}
        if merged or restore:
            self._push(list({**restore, **merged}.items()))

    def sleep(self) -> None:
        """Release the engine's GPU memory (weights, KV cache and page landmarks: TensorRT-LLM's sleep)."""
        if self._asleep:
            return
        self._llm._collective_rpc("sleep", args=(list(SLEEP_TAGS),))
        self._asleep = True

    def wake(self) -> None:
        """Take the memory back (weights restored by TensorRT-LLM; the KV cache comes back empty)."""
        if not self._asleep:
            return
        self._llm._collective_rpc("wakeup", args=(list(SLEEP_TAGS),))
        self._asleep = False

    # ----------------------------------------------------------------- internals
    def _check_awake(self) -> None:
        if self._asleep:
            raise RuntimeError("the TensorRT-LLM rollout engine is asleep: call wake() first")

    def _use_schedule(self, schedule: BudgetSchedule) -> None:
        """Push ``schedule`` to the workers when it differs from the current one."""
        if schedule == self.spec.schedule:
            return
        self.spec = self.spec.with_schedule(schedule)
        self._llm._collective_rpc("set_sparrow_schedule", args=(self.spec.to_config_dict(),))

    def _push(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Send tensors to this GPU's engine worker as IPC handles keyed by this GPU, then finalise."""
        from torch.multiprocessing.reductions import reduce_tensor

        for message in refit_messages(
            named, self._device_uuid, self._device, REFIT_BUCKET_BYTES, reduce_tensor
        ):
            if message is not None:
                check_handles(message, self._worker_uuids)
            self._llm._collective_rpc("update_weights", args=(message,))
