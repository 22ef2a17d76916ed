"""megatron's ``GPTModel`` without its logits: the forward returns the final hidden states.

The output layer (its weight, checkpoint names and TP layout unchanged) is applied outside, fused with
the logprobs in chunks (:func:`sparrow_nemo.policy.logprobs.policy_outputs`), so a step never holds the
``[S, V]`` logits. Imports megatron-core; :mod:`sparrow_nemo.policy.model` imports this lazily.
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel


class HiddenStateGPTModel(GPTModel):
    """``GPTModel`` whose forward ends at the final norm: hidden states ``[S, B, H]`` on every stage
    (``[S/tp, B, H]`` under sequence parallelism), as megatron returns them from non-last stages."""

    def _postprocess(self, hidden_states, **_unused):
        return hidden_states
