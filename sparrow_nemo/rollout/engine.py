"""The rollout-engine interface: what GRPO, calibration and benchmarks need from a generator.

Backends (``reference``: plain torch with a paged KV cache; ``trtllm``: TensorRT-LLM on the cluster)
implement :class:`RolloutEngine`. Results come back as a :class:`RolloutBatch` of per-sample
:class:`RolloutSample` records (variable-length 1-D/2-D tensors per sample, no padding).

Process model (the trainer's, :mod:`sparrow_nemo.grpo.process_model`): one engine per GPU, colocated with
that GPU's policy rank (``rollout.tensor_parallel_size = 1``), each generating its own share of the step; with
engine tensor parallelism ``k > 1`` one engine spans ``k`` consecutive tensor-parallel ranks and its first rank
holds the engine object. Per step the trainer calls, on every rank holding an engine:
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
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from sparrow_nemo.rollout.lora import LoraAdapter
from sparrow_nemo.sparse.schedule import BudgetSchedule

FinishReason = Literal["stop_token", "stop_string", "length"]

#: ``on_tokens(n)``: ``n`` more response tokens were generated since the previous call (progress bars).
TokenProgress = Callable[[int], None]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch.

    Attributes:
        max_new_tokens: response length cap (tokens); also capped by the model's max positions.
        temperature: softmax temperature for sampling; 0 means greedy (argmax, lowest id on ties).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: base seed; sample i draws from its own generator seeded by ``sample_seed(seed, i)``.
        stop_token_ids: ids that end a response (kept as its last token); None = the model's EOS,
            () = none (benchmarks ignore EOS this way).
        stop_strings: texts that end a response once the decoded response contains them (needs an
            engine tokenizer); the token completing the string is kept.
        logprobs_topk: how many top (id, logprob) pairs to return per position.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    logprobs_topk: int = 20

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.logprobs_topk <= 0:
            raise ValueError(f"SamplingParams.logprobs_topk must be > 0, got {self.logprobs_topk}")
        if any(not s for s in self.stop_strings):
            raise ValueError("SamplingParams.stop_strings must not contain an empty string")


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
    """Samples in prompt order, plus timing of the call (seconds, wall clock)."""

    samples: list[RolloutSample]
    schedule_name: str
    prefill_s: float
    decode_s: float

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
        tokens were generated, as the engine can see them: every few decode steps for the reference
        engine, once at the end for TensorRT-LLM.
        """
        ...

    def score(self, sequences: Sequence[Sequence[int]], topk: int = 20) -> list[ScoredSequence]:
        """Dense teacher-forced logprobs and top-K of every next token (no LoRA)."""
        ...

    def update_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Refit in place, without rebuilding, from a piece of the policy's new weights.

        The contract (:mod:`sparrow_nemo.grpo.refit`): called once per piece of the model (the embedding,
        each decoder layer, the final norm and output layer), in that order, on every rank that holds an
        engine; ``state`` maps HF Qwen3 names to the *full* tensors (gathered within the policy's TP group
        and across its pipeline stages) on this rank's own device, in the policy's dtype; they are valid only
        during the call (copy what is kept). With engine tensor parallelism ``k > 1`` the engine takes its
        own slice of each full tensor. Called while awake.
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
