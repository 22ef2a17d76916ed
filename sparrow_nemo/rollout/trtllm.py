"""The TensorRT-LLM rollout engine (``rollout.backend: trtllm``; extra ``cluster``, tensorrt-llm 1.2.0).

:class:`TrtllmRolloutEngine` implements :class:`~sparrow_nemo.rollout.engine.RolloutEngine` over
``tensorrt_llm.LLM`` (PyTorch backend) with Sparrow's sparse decode attention registered as the
``sparse_attention_config`` algorithm "sparrow" (:mod:`sparrow_nemo.rollout.trtllm_plugin`):

- generation: one request per prompt with its own seed, ``logprobs=K`` for the top-K the mismatch
  statistics need; outputs are mapped to :class:`RolloutSample` by :func:`to_rollout_sample`;
- schedule: the plugin reads the budgets from the spec pushed to every worker before each call
  (``set_sparrow_schedule``), so a schedule adapted by the trainer applies from the next call on;
- refit: HF-named tensors (:func:`~sparrow_nemo.rollout.trtllm_weights.refit_tensors`) sent as CUDA IPC
  handles to the RL worker extension's ``update_weights``, in buckets, then finalized; no rebuild;
- LoRA (DistillSparse): merged into the linears it targets (``W + scaling B A``); :meth:`score` (dense,
  no adapter) swaps the base weights in for its duration;
- sleep/wake: TensorRT-LLM's sleep mode (weights and KV cache released), the centroid pools dropped.

Everything that needs no TensorRT-LLM (kwargs, sampling translation, output mapping) is a plain function
here and tested on CPU; ``import sparrow_nemo.rollout.trtllm`` works without TensorRT-LLM, constructing
the engine raises :class:`~sparrow_nemo._optional.MissingOptionalDependency` naming the extra.

Logprob convention: TensorRT-LLM returns the log-probabilities of the distribution it samples from; they
equal this project's convention (temperature 1, before top-k/top-p) when sampling is at temperature 1
without top-k/top-p filtering, the paper's setting. The engine logs a warning otherwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from sparrow_nemo._optional import require
from sparrow_nemo.model_shapes import Qwen3Shape
from sparrow_nemo.rollout.engine import (
    RolloutBatch,
    RolloutSample,
    SamplingParams,
    ScoredSequence,
    TokenProgress,
)
from sparrow_nemo.rollout.lora import LoraAdapter
from sparrow_nemo.rollout.sampling import batch_seeds
from sparrow_nemo.rollout.trtllm_sparse import SparrowSparseSpec
from sparrow_nemo.rollout.trtllm_weights import buckets, merge_lora, refit_tensors
from sparrow_nemo.sparse.schedule import DENSE_BUDGET, BudgetSchedule

log = logging.getLogger(__name__)

#: the TensorRT-LLM release this engine and its plugin were written against (pyproject extra ``cluster``)
TRTLLM_VERSION = "1.2.0"
#: memory tags released by sleep() / taken back by wake() (tensorrt_llm ExecutorMemoryType values)
SLEEP_TAGS = ("model", "kv_cache", "executor_extra", "model_extra", "sampler")
#: bytes per IPC weight bucket
REFIT_BUCKET_BYTES = 1 << 30


class TokenLogprob(Protocol):
    """One entry of TensorRT-LLM's per-position logprob dict (``tensorrt_llm.executor.result.Logprob``)."""

    logprob: float


class CompletionLike(Protocol):
    """The fields of ``tensorrt_llm`` ``CompletionOutput`` this engine reads."""

    token_ids: list[int]
    logprobs: list[dict[int, TokenLogprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


#: share of the GPU memory free after loading the engine that TensorRT-LLM takes for its KV cache pool
#: (``kv_cache_config.free_gpu_memory_fraction``; ``sparrow plan`` sizes the rollout KV cache with it)
KV_FREE_GPU_MEMORY_FRACTION = 0.85


def llm_kwargs(config: Any, model_dir: str | Path, spec: SparrowSparseSpec) -> dict[str, Any]:
    """Keyword arguments of ``tensorrt_llm.LLM`` for a recipe (``SparrowConfig``) and its sparse spec.

    ``sparse_attention_config`` is the spec's dict; the engine turns it into the plugin's config class.
    """
    r, data = config.rollout, config.data
    return {
        "model": str(model_dir),
        "backend": "pytorch",
        "tensor_parallel_size": config.policy.tensor_model_parallel_size,
        "dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[config.model.dtype],
        "max_batch_size": r.max_batch_size,
        "max_seq_len": data.max_prompt_tokens + r.max_new_tokens,
        "sparse_attention_config": spec.to_config_dict(),
        "kv_cache_config": {
            "enable_block_reuse": False,  # a reused block would carry no centroid
            "tokens_per_block": spec.page_size,  # one centroid per KV block
            "free_gpu_memory_fraction": KV_FREE_GPU_MEMORY_FRACTION,
        },
        "enable_chunked_prefill": False,  # prompts' centroids are written in one prefill
        "attn_backend": "TRTLLM",
        "cuda_graph_config": None,  # the page prediction reads block tables on the host each step
        "enable_sleep_mode": True,
        "orchestrator_type": "ray",
        "ray_worker_extension_cls": "sparrow_nemo.rollout.trtllm_plugin.SparrowWorkerExtension",
    }


def sampling_kwargs(sampling: SamplingParams, seed: int, eos_token_id: int) -> dict[str, Any]:
    """Keyword arguments of ``tensorrt_llm.SamplingParams`` for one request of ``sampling``."""
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


def _topk_entries(entries: Mapping[int, TokenLogprob], k: int, where: str) -> tuple[list[int], list[float]]:
    """The k most likely (id, logprob) of a position, descending (ties: lower id first)."""
    if len(entries) < k:
        raise ValueError(
            f"{where}: TensorRT-LLM returned {len(entries)} logprobs, fewer than logprobs_topk={k}"
        )
    ranked = sorted(entries.items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:k]
    return [i for i, _ in ranked], [float(lp.logprob) for _, lp in ranked]


def to_rollout_sample(
    prompt_ids: Sequence[int],
    completion: CompletionLike,
    topk: int,
    schedule: BudgetSchedule,
    stop_token_ids: Sequence[int],
) -> RolloutSample:
    """One TensorRT-LLM completion -> :class:`RolloutSample` (same fields as the reference engine's).

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
        if token not in entries:
            raise ValueError(f"token {i}: the sampled id {token} is missing from TensorRT-LLM's logprobs")
        sampled.append(float(entries[token].logprob))
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
    ids: Sequence[int], prompt_logprobs: Sequence[Mapping[int, TokenLogprob] | None], topk: int
) -> ScoredSequence:
    """TensorRT-LLM ``prompt_logprobs`` of a sequence -> :class:`ScoredSequence` (entry t predicts t + 1).

    ``prompt_logprobs`` has one entry per token: the first (nothing predicts it) may be None or absent.
    """
    entries = list(prompt_logprobs)
    if len(entries) == len(ids):
        entries = entries[1:]
    if len(entries) != len(ids) - 1:
        raise ValueError(
            f"prompt_logprobs has {len(prompt_logprobs)} entries for a sequence of {len(ids)} tokens"
        )
    lp, top_ids, top_lp = [], [], []
    for t, e in enumerate(entries):
        target = ids[t + 1]
        if e is None or target not in e:
            raise ValueError(
                f"position {t + 1}: token {target} is missing from TensorRT-LLM's prompt_logprobs"
            )
        lp.append(float(e[target].logprob))
        i, p = _topk_entries(e, topk, f"position {t + 1}")
        top_ids.append(i)
        top_lp.append(p)
    return ScoredSequence(
        logprobs=torch.tensor(lp, dtype=torch.float32),
        top_ids=torch.tensor(top_ids, dtype=torch.int64).view(-1, topk),
        top_logprobs=torch.tensor(top_lp, dtype=torch.float32).view(-1, topk),
    )


class TrtllmRolloutEngine:
    """:class:`~sparrow_nemo.rollout.engine.RolloutEngine` over ``tensorrt_llm.LLM`` (see the module docstring).

    Args:
        model_dir: HF Qwen3 checkpoint directory (config, tokenizer, safetensors) the LLM starts from.
        shape: its :class:`Qwen3Shape` (refit checks). spec: the sparse settings and initial schedule.
        kwargs: ``tensorrt_llm.LLM`` keyword arguments (e.g. :func:`llm_kwargs`), ``model`` included.
        dtype: the engine's weight dtype (refit tensors are cast to it).
    """

    def __init__(
        self,
        shape: Qwen3Shape,
        spec: SparrowSparseSpec,
        kwargs: Mapping[str, Any],
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        trtllm = require("tensorrt_llm")
        from sparrow_nemo.rollout import trtllm_plugin

        args = dict(kwargs)
        args["sparse_attention_config"] = trtllm_plugin.SparrowSparseAttentionConfig(**spec.to_config_dict())
        self._trtllm = trtllm
        self.shape = shape
        self.spec = spec
        self.dtype = dtype
        self._llm = trtllm.LLM(**args)
        self._base: dict[str, torch.Tensor] = {}
        self._lora: LoraAdapter | None = None
        self._asleep = False

    @classmethod
    def from_recipe(cls, config: Any, model_dir: str | Path) -> TrtllmRolloutEngine:
        """The engine a recipe (``SparrowConfig``) describes, started from ``model_dir``."""
        from sparrow_nemo.policy.hf_import import SafetensorsDir, shape_from_hf_config
        from sparrow_nemo.policy.model import resolve_dtype

        spec = SparrowSparseSpec.from_recipe(config)
        shape = shape_from_hf_config(SafetensorsDir(model_dir).config())
        return cls(shape, spec, llm_kwargs(config, model_dir, spec), resolve_dtype(config.model.dtype))

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
        """Sample one response per prompt; sample i uses seed ``sample_seeds[i]`` (default
        ``sample_seed(sampling.seed, i)``). ``on_tokens`` hears the total once, when ``LLM.generate``
        returns (it runs the batch as one call)."""
        seeds = batch_seeds(sampling.seed, len(prompts), sample_seeds)
        self._check_awake()
        if sampling.temperature not in (0.0, 1.0) or sampling.top_k or sampling.top_p < 1.0:
            log.warning(
                "TensorRT-LLM logprobs follow the sampling distribution; with temperature=%s top_k=%s top_p=%s "
                "they differ from the temperature-1 unfiltered logprobs the mismatch statistics assume",
                sampling.temperature,
                sampling.top_k,
                sampling.top_p,
            )
        self._use_schedule(schedule)
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
        """Dense teacher-forced scores (prompt logprobs of a 1-token request), without the LoRA adapter."""
        self._check_awake()
        if not sequences:
            return []
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
        """Refit from HF-named tensors (a subset is fine); an active LoRA adapter is re-merged on top."""
        self._check_awake()
        named = refit_tensors(state, self.shape, self.dtype)
        self._base.update({n: t.to("cpu", copy=True) for n, t in named})  # LoRA merges start from these
        if self._lora is not None:
            named = list({**dict(named), **merge_lora(self._base, self._lora, self.shape)}.items())
        self._push(named)

    def set_lora(self, adapter: LoraAdapter | None) -> None:
        """Merge ``adapter`` into the linears it targets (None restores the base weights of the last one)."""
        self._check_awake()
        previous, self._lora = self._lora, adapter
        names = set() if previous is None else {f"{m}.weight" for m in previous.weights}
        merged = {} if adapter is None else merge_lora(self._base, adapter, self.shape)
        restore = {n: self._base[n] for n in names - set(merged)}
        if merged or restore:
            self._push(list({**restore, **merged}.items()))

    def sleep(self) -> None:
        """Release GPU memory (weights and KV cache, TensorRT-LLM sleep mode) and the centroid pools."""
        if self._asleep:
            return
        self._llm._collective_rpc("reset_sparrow_centroids")
        self._llm._collective_rpc("sleep", args=(list(SLEEP_TAGS),))
        self._asleep = True

    def wake(self) -> None:
        """Take the memory back (weights restored by TensorRT-LLM)."""
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
        """Send tensors to the workers as CUDA IPC handles, bucket by bucket, then finalize the load."""
        from tensorrt_llm._torch.utils import get_device_uuid
        from torch.multiprocessing.reductions import reduce_tensor

        device = torch.cuda.current_device()
        uuid = get_device_uuid(device)
        for group in buckets(named, REFIT_BUCKET_BYTES):
            on_gpu = [(n, t.to(f"cuda:{device}")) for n, t in group]
            handles = {uuid: [(n, reduce_tensor(t)) for n, t in on_gpu]}
            self._llm._collective_rpc("update_weights", args=(handles,))
            del on_gpu
        self._llm._collective_rpc("update_weights", args=(None,))
