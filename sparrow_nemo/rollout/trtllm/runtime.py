"""Start-up check: is the installed TensorRT-LLM the one this adapter was written against?

The adapter (``rollout/trtllm*.py``) was written against the 1.2 line of NVIDIA/TensorRT-LLM, read file by
file (docs/trtllm.md lists which files and versions). Two of its contracts are not
in every build of that line, so besides the version the check probes them:

- the sampled token's logprob: ``tensorrt_llm/_torch/pyexecutor/sampler.py`` ``TorchSampler`` returns the
  top-K raw logprobs and, in the builds this adapter needs, adds the sampled token when it is outside
  them (``LogProbsState.sampled_vals`` / ``sampled_indices`` / ``sampled_rank``,
  ``_store_logprobs_list_to_request``: rank ``max(K + 1, rank + 1)``). Without it a rollout token
  outside the top-20 has no logprob (the rollout/train ratio needs one for every token);
- TorchLlmArgs' ``enable_sleep`` and ``ray_worker_extension_cls`` fields (sleep/wake and refit).

:func:`check_runtime` is a pure function of a :class:`TrtllmRuntime` record (tested on CPU with the
records of the sources read); :func:`probe_runtime` fills the record from the installed package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import ModuleType

#: the TensorRT-LLM release this adapter was written against (pyproject extra ``cluster``, docker/Dockerfile)
TRTLLM_VERSION = "1.2.0"
#: ``LogProbsState`` fields of a TorchSampler that returns the sampled token's logprob
SAMPLED_LOGPROB_FIELDS = frozenset({"sampled_vals", "sampled_indices", "sampled_rank"})
#: TorchLlmArgs fields the engine's constructor sets that not every 1.x build has
REQUIRED_LLM_ARGS = frozenset(
    {"enable_sleep", "ray_worker_extension_cls", "orchestrator_type", "sampler_type"}
)


class TrtllmVersionError(RuntimeError):
    """The installed TensorRT-LLM is not the build this adapter was written for."""


@dataclass(frozen=True)
class TrtllmRuntime:
    """What the start-up check needs to know about an installed TensorRT-LLM.

    Attributes:
        version: ``tensorrt_llm.__version__``.
        logprob_state_fields: field names of ``tensorrt_llm._torch.pyexecutor.sampler.LogProbsState``
            (empty when the class does not exist).
        llm_args_fields: field names of ``tensorrt_llm.llmapi.llm_args.TorchLlmArgs``.
    """

    version: str
    logprob_state_fields: frozenset[str]
    llm_args_fields: frozenset[str]


def check_runtime(runtime: TrtllmRuntime, expected_version: str = TRTLLM_VERSION) -> None:
    """Raise :class:`TrtllmVersionError` listing every way ``runtime`` differs from what the adapter needs."""
    problems = []
    if runtime.version != expected_version:
        problems.append(
            f"version {runtime.version} is installed, the adapter was written for {expected_version}"
        )
    missing_sampler = sorted(SAMPLED_LOGPROB_FIELDS - runtime.logprob_state_fields)
    if missing_sampler:
        problems.append(
            "TorchSampler does not return the sampled token's logprob when it is outside the top-K "
            f"(tensorrt_llm._torch.pyexecutor.sampler.LogProbsState lacks {missing_sampler})"
        )
    missing_args = sorted(REQUIRED_LLM_ARGS - runtime.llm_args_fields)
    if missing_args:
        problems.append(f"TorchLlmArgs has no field(s) {missing_args}")
    if problems:
        raise TrtllmVersionError(
            "rollout.backend=trtllm: the installed TensorRT-LLM does not match this adapter: "
            + "; ".join(problems)
            + f". Use the image of docker/Dockerfile (tensorrt-llm=={expected_version}) or rollout.backend=torch."
        )


def probe_runtime(trtllm: ModuleType) -> TrtllmRuntime:
    """The :class:`TrtllmRuntime` of the imported ``tensorrt_llm`` package (imports two of its modules)."""
    from tensorrt_llm._torch.pyexecutor import sampler
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    state = getattr(sampler, "LogProbsState", None)
    fields = (
        frozenset(f.name for f in dataclasses.fields(state))
        if dataclasses.is_dataclass(state)
        else frozenset()
    )
    return TrtllmRuntime(
        version=str(getattr(trtllm, "__version__", "unknown")),
        logprob_state_fields=fields,
        llm_args_fields=frozenset(TorchLlmArgs.model_fields),
    )
