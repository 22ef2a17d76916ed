"""The rollout-engine interface: what GRPO, calibration and benchmarks need from a generator.

Backends (``torch``: plain torch with a paged KV cache, continuous batching; ``trtllm``: TensorRT-LLM on the cluster)
implement :class:`RolloutEngine`. Results come back as a :class:`RolloutBatch` of per-sample
:class:`RolloutSample` records (variable-length 1-D/2-D tensors per sample, no padding).

Process model (the trainer's, :mod:`sparrow_nemo.grpo.process_model`): one engine per GPU, colocated with
that GPU's policy rank (``rollout.tensor_parallel_size = 1``), each generating its own share of the step; with
engine tensor parallelism ``k > 1`` (the torch backend) one engine spans ``k`` consecutive tensor-parallel ranks,
each holding its shard and making every call with the same arguments (its first rank keeps the samples). Per
step the trainer calls, on every rank holding an engine:
``generate`` (its prompts) -> ``sleep`` (before training) -> ``wake`` -> ``update_weights`` (the refit, when
the update changed the weights) [-> ``set_lora`` with DistillSparse] -> the next ``generate``.

Conventions:
- Logprobs are natural-log probabilities of the model's next-token distribution (softmax of the raw
  logits, i.e. temperature 1, before top-k/top-p filtering); that is the distribution the dense policy
  scores and the one the acceptance rate compares.
- ``cached_len`` of response token i = prompt_len + i: the tokens in the KV cache when it was sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, UNIT, Section, interval, knob, one_of
from sparrow_nemo.hf_qwen3 import LoraAdapter
from sparrow_nemo.sparse.cost_model import HARDWARE
from sparrow_nemo.sparse.schedule import BudgetSchedule

FinishReason = Literal["stop_token", "stop_string", "length"]

#: ``on_tokens(n)``: ``n`` more response tokens were generated since the previous call (progress bars).
TokenProgress = Callable[[int], None]


@dataclass(frozen=True)
class MismatchInjection(Section):
    """Mismatch injected at a matched mean (``rollout.inject_mismatch``; an experiment's control, not a method).

    At a ``fraction`` of response positions, chosen by a hash of the sample's seed and the position
    (:data:`sparrow_nemo.rollout.sampling.INJECT`: independent of batching), the token is drawn from
    ``q = (1 - mix) p + mix u`` (p: the model's next-token distribution, u: uniform over the V ids) and the
    rollout records q's logprobs (the sampled token's and the top-K), so the importance correction sees the
    true behaviour policy; every other position decodes densely as usual. The acceptance rate of an injected
    position is exactly ``alpha = sum_v min(p_v, q_v) = 1 - mix * TV(p, u)``, ``TV(p, u) = sum_v max(p_v - 1/V, 0)``
    (~1 - 1/V for a peaked p), and 1 elsewhere; over all tokens ``mean alpha = 1 - fraction * mix * E[TV]``,
    while a quantile q0 sits at ``1 - mix * TV`` when ``fraction > q0`` and at 1 when ``fraction < q0``. Read by
    :func:`sparrow_nemo.rollout.sampling.injection_mix` (torch engine; needs plain sampling: temperature 1, no
    top-k / top-p; refused with speculative rollout, whose dense verify would undo it).
    """

    fraction: float = knob(0.0, "share of response positions drawn from the mixture; 0 = off", check=UNIT)
    mix: float = knob(0.0, "weight d of the uniform distribution in the mixture (1 - d) p + d u", check=UNIT)

    @property
    def on(self) -> bool:
        """True when some positions are injected."""
        return self.fraction > 0 and self.mix > 0


@dataclass(frozen=True)
class SamplingParams(Section):
    """How to sample one batch (the sampling keys of the recipe's ``rollout`` section, :class:`RolloutConfig`).

    Sample i of a batch draws from its own generator seeded by ``sample_seed(seed, i)``.
    """

    max_new_tokens: int = knob(
        256, "response length cap, tokens (also capped by the model's max positions)", check=AT_LEAST_ONE
    )
    temperature: float = knob(
        1.0, "softmax temperature; 0 = greedy (argmax, lowest id on ties; not for RL)", check=NON_NEGATIVE
    )
    top_p: float = knob(1.0, "nucleus sampling mass; 1 = off", check=interval(0, 1, lo_open=True))
    top_k: int = knob(0, "sample among the k most likely tokens; 0 = off", check=NON_NEGATIVE)
    seed: int = knob(0, "base seed of the per-sample sampling generators", check=NON_NEGATIVE)
    stop_token_ids: tuple[int, ...] | None = knob(
        None,
        "token ids that end a response (kept as its last token); null = the model's EOS, [] = none",
        check=NON_NEGATIVE,
    )
    stop_strings: tuple[str, ...] = knob(
        (), "texts that end a response once it contains them (needs an engine tokenizer)"
    )
    logprobs_topk: int = knob(
        20,
        "top (id, logprob) pairs returned per position, also K of the trainer's dense side; the acceptance "
        "rate is a lower bound from both top-K lists (paper: 20), exact once K >= the vocabulary",
        check=AT_LEAST_ONE,
    )

    inject_mismatch: MismatchInjection = knob(
        doc="mismatch injected at a hash-chosen share of positions (experiments' controls; default off)",
        factory=MismatchInjection,
    )

    def check(self) -> None:
        for i, text in enumerate(self.stop_strings):
            if not text:
                raise self.invalid(f"stop_strings.{i}", "a non-empty string")
        if self.inject_mismatch.on and (self.temperature != 1 or self.top_k or self.top_p < 1):
            raise self.invalid("inject_mismatch", "off unless temperature=1, top_k=0 and top_p=1")


@dataclass(frozen=True)
class RolloutConfig(SamplingParams):
    """The recipe's ``rollout`` section: the sampling settings plus the engine's own."""

    renamed_keys: ClassVar[dict[str, str]] = {"speculative": "it moved: control.speculative"}

    backend: str = knob(
        "torch",
        "engine: torch (sparrow_nemo.rollout.torch.engine: paged KV cache, CPU or GPUs) or trtllm (cluster)",
        check=one_of(("torch", "trtllm"), renamed={"reference": "torch"}),
    )
    mode: Literal["sparse", "speculative", "dense"] = knob(
        "sparse",
        "how rollouts decode: sparse (the sparsity schedule), speculative (sparse drafts verified by dense "
        "forwards: dense-distributed samples, the importance ratio exactly 1; the draft plan: control.speculative) "
        "or dense (sparrow_nemo.rollout.rollout_mode)",
    )
    max_batch_size: int = knob(
        64,
        "the most sequences decoding at once (vLLM's max_num_seqs); admission is limited by free KV pages, "
        "and on CUDA the largest CUDA-graph batch bucket",
        check=AT_LEAST_ONE,
    )
    kv_cache_fraction: float = knob(
        0.9,
        "share of the device memory free when the engine sizes its KV pool after a wake (what the policy's "
        "resident state and the engine's weights leave; vLLM's gpu_memory_utilization); CUDA only",
        check=interval(0, 1, lo_open=True),
    )
    max_cache_tokens: int | None = knob(
        None,
        "the engine's KV pool in tokens (whole pages), instead of kv_cache_fraction; null = the fraction on CUDA, "
        "and on the CPU whatever a call could need (no preemption)",
        check=AT_LEAST_ONE,
    )
    prefill_chunk_tokens: int = knob(
        512, "prompt tokens per prefill chunk (a multiple of sparsity.page_size)", check=AT_LEAST_ONE
    )
    attention_impl: Literal["auto", "torch", "triton"] = knob(
        "auto", "decode attention: torch gather path, Triton kernels, or auto (Triton where it can run)"
    )
    cost_hardware: str = knob(
        "auto",
        "constants of the decode cost model (predicted speedups, the speculative planner): auto (a GPU's preset "
        "by its name; on the CPU fitted at startup from timed decode steps of the engine), h200, h100, or a "
        "Hardware JSON file (sparrow_nemo.rollout.tools.cost_fit)",
    )
    tensor_parallel_size: int = knob(
        1,
        "GPUs per rollout engine of the trainer (engine tensor parallelism). 1 = one engine per GPU, colocated "
        "with that GPU's policy rank; k > 1 (torch backend; must divide policy.tensor_model_parallel_size and the "
        "model's KV heads) = one engine sharded over k consecutive tensor-parallel ranks (1/k of the weights and "
        "KV heads per GPU; at k = the policy's TP the refit hands each rank its own shard), for a model whose "
        "weights leave a single GPU too little KV cache (sparrow_nemo.grpo.process_model). sparrow eval and "
        "calibrate run one engine on one device",
        check=AT_LEAST_ONE,
    )

    def check(self) -> None:
        super().check()
        if self.temperature == 0:
            raise self.invalid("temperature", "a number > 0")
        if self.cost_hardware not in ("auto", *HARDWARE) and not self.cost_hardware.endswith(".json"):
            raise self.invalid("cost_hardware", f"auto, {', '.join(HARDWARE)} or a path ending in .json")
        if self.inject_mismatch.on and (self.mode == "speculative" or self.backend != "torch"):
            raise self.invalid("inject_mismatch", "off with rollout.mode=speculative or backend trtllm")
        if self.mode == "speculative" and self.backend != "torch":
            raise self.invalid(
                "mode", "sparse or dense with backend trtllm (speculative rollout runs on the torch engine)"
            )

    def sampling(self, seed: int | None = None) -> SamplingParams:
        """The :class:`SamplingParams` part; ``seed`` replaces ``self.seed`` (one per RL step)."""
        names = [f.name for f in fields(SamplingParams)]
        values = {name: getattr(self, name) for name in names}
        if seed is not None:
            values["seed"] = seed
        return SamplingParams(**values)


@dataclass
class RolloutSample:
    """One generated response. Lr = response length, K = logprobs_topk.

    Attributes:
        prompt_ids: [Lp] int64.
        response_ids: [Lr] int64 (a stop token or the token completing a stop string is included).
        logprobs: [Lr] float32, logprob of each sampled token under the engine.
        top_ids, top_logprobs: [Lr, K] int64 / float32, the engine's top-K per position, descending.
        cached_len: [Lr] int64, tokens in the KV cache when the token was sampled (prompt_len + i).
        kv_budget: [Lr] int64, KV budget (tokens) of the sparse layers for that token (the
            schedule at cached_len; ``DENSE_BUDGET`` for the first token, which comes from dense prefill).
        finish_reason: "stop_token", "stop_string" or "length".
        stop: the stop token id or stop string that ended the response, else None.
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    cached_len: torch.Tensor
    kv_budget: torch.Tensor
    finish_reason: FinishReason
    stop: int | str | None = None


@dataclass
class RolloutBatch:
    """Samples in prompt order, plus timing of the call (seconds, wall clock) and what its scheduler did.

    Attributes:
        samples: one per prompt, in prompt order. schedule_name: the schedule (or speculative plan) used.
        prefill_s, decode_s: seconds of prefill (admissions: prefill, recompute, first tokens) and of decoding.
        decode_steps: batched decode steps (speculative rounds) the engine ran; 0 where the backend does not say.
        preemptions: sequences that lost their KV pages to make room and were recomputed later.
        peak_pages: the most KV pages held at once; capacity_pages: the pages the KV pool holds.
    """

    samples: list[RolloutSample]
    schedule_name: str
    prefill_s: float
    decode_s: float
    decode_steps: int = 0
    preemptions: int = 0
    peak_pages: int = 0
    capacity_pages: int = 0

    @property
    def num_response_tokens(self) -> int:
        """Generated tokens over all samples."""
        return sum(int(s.response_ids.numel()) for s in self.samples)

    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time (prefill + decode)."""
        total = self.prefill_s + self.decode_s
        return self.num_response_tokens / total if total > 0 else float("nan")


@dataclass
class ScoredSequence:
    """Dense teacher-forced scores of one sequence of length L (entry t predicts token t + 1).

    Attributes:
        logprobs: [L-1] float32, logprob of token t+1 given tokens 0..t.
        top_ids, top_logprobs: [L-1, K] int64 / float32, top-K of that distribution, descending.
    """

    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


class TokenTally:
    """Reports generated tokens to an optional :data:`TokenProgress` callback, off the decode hot path.

    ``add(n)`` once per decode step (or block of steps) with that step's new tokens; the callback runs
    at most once every ``every`` calls and on :meth:`flush`, so a progress bar costs nothing per token.
    Without a callback every method is a no-op.
    """

    def __init__(self, on_tokens: TokenProgress | None, every: int = 16) -> None:
        if every <= 0:
            raise ValueError(f"TokenTally.every must be > 0 steps, got {every}")
        self.on_tokens = on_tokens
        self.every = every
        self._pending = 0
        self._calls = 0

    def add(self, n: int) -> None:
        """Count ``n`` new tokens; report the pending count every ``every`` calls."""
        if self.on_tokens is None:
            return
        self._pending += n
        self._calls += 1
        if self._calls % self.every == 0:
            self.flush()

    def flush(self) -> None:
        """Report what is pending (call at the end of a generate)."""
        if self.on_tokens is not None and self._pending:
            self.on_tokens(self._pending)
            self._pending = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """A generator the RL loop drives; see the module docstring for conventions."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        schedule: BudgetSchedule,
        *,
        sample_seeds: Sequence[int] | None = None,
        on_tokens: TokenProgress | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt with the sparse layers following ``schedule``.

        Sample i draws from seed ``sample_seeds[i]`` (default ``sample_seed(sampling.seed, i)``), so a part
        of a batch reproduces its samples in the whole batch. ``on_tokens`` (optional) is told how many
        tokens were generated, as the engine can see them: every few decode steps for the torch
        engine, once at the end for TensorRT-LLM.
        """
        ...

    def score(self, sequences: Sequence[Sequence[int]], topk: int = 20) -> list[ScoredSequence]:
        """Dense teacher-forced logprobs and top-K of every next token (no LoRA)."""
        ...

    def update_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Refit in place, without rebuilding, from a piece of the policy's new weights.

        The contract (:mod:`sparrow_nemo.policy.refit`): called once per piece of the model (the embedding,
        each decoder layer, the final norm and output layer), in that order, on every rank that holds an
        engine; ``state`` maps HF Qwen3 names to the *full* tensors (gathered within the policy's TP group
        and across its pipeline stages) on this rank's own device, in the policy's dtype; they are valid only
        during the call (copy what is kept). With engine tensor parallelism ``k > 1`` the engine takes its
        own slice of each full tensor, and an engine over the policy's whole TP group receives only its own
        slices (the refit then gathers nothing). Called while awake.
        """
        ...

    def set_lora(self, adapter: LoraAdapter | None) -> None:
        """Use ``adapter`` in generation from now on (DistillSparse); None removes it."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (KV cache; weights move off the GPU) before training: the trainer calls
        it after every rollout, so the KV cache and the training activations never coexist."""
        ...

    def wake(self) -> None:
        """Take the memory back (before the refit); generation after wake() equals generation before sleep()."""
        ...


class EngineWrapper:
    """Base of engines that wrap another one: every attribute it does not define is the wrapped engine's.

    Args:
        engine: the wrapped :class:`RolloutEngine`.
    """

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)
