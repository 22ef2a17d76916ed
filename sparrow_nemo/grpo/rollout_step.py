"""From a step's rollouts to what the policy trains on: padded micro-batches, dense scores, mismatch.

Token layout: sample i is ``prompt_i + response_i`` (N samples, right-padded with ``pad_id`` to S tokens).
Policy outputs are [N, S-1] with entry j scoring token j + 1, so response token t of sample i sits at
column ``len(prompt_i) - 1 + t``; ``response_mask`` [N, S-1] marks those columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparrow_nemo.grpo.process_model import SampleShare
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.packing import concat_outputs, micro_batches
from sparrow_nemo.rollout.engine import RolloutSample
from sparrow_nemo.rollout.scoring import TokenMismatch
from sparrow_nemo.sparse.mismatch import acceptance_rate_topk


@dataclass
class RolloutTensors:
    """A step's rollouts as padded tensors (CPU).

    Attributes:
        tokens: [N, S] int64 prompt + response, right-padded.
        lengths: [N] int64 real tokens per row.
        response_mask: [N, S-1] bool, True at the columns that score a response token.
        rollout_logprobs: [N, S-1] float32 engine (sparse) logprob of each response token, 0 elsewhere.
        advantages: [N] float32 per-sample advantage.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor

    def rows(self, index: slice) -> RolloutTensors:
        """The rows ``index`` (same width)."""
        return RolloutTensors(
            self.tokens[index],
            self.lengths[index],
            self.response_mask[index],
            self.rollout_logprobs[index],
            self.advantages[index],
        )


def pad_pairs(
    prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ``prompt_i + response_i`` (1-D int64 each) -> (tokens [N, S], lengths [N], response_mask [N, S-1])."""
    n = len(prompts)
    lengths = torch.tensor([p.numel() + r.numel() for p, r in zip(prompts, responses)], dtype=torch.int64)
    width = int(lengths.max())
    tokens = torch.full((n, width), pad_id, dtype=torch.int64)
    mask = torch.zeros(n, width - 1, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tokens[i, : p.numel() + r.numel()] = torch.cat([p, r])
        mask[i, p.numel() - 1 : p.numel() - 1 + r.numel()] = True
    return tokens, lengths, mask


def collate(samples: Sequence[RolloutSample], advantages: torch.Tensor, pad_id: int = 0) -> RolloutTensors:
    """Pad ``samples`` into :class:`RolloutTensors`; ``advantages`` is [N], one per sample."""
    n = len(samples)
    if advantages.shape != (n,):
        raise ValueError(f"collate: advantages {tuple(advantages.shape)} for {n} samples")
    tokens, lengths, mask = pad_pairs(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id
    )
    rollout_lp = torch.zeros(mask.shape, dtype=torch.float32)
    rollout_lp[mask] = torch.cat([s.logprobs.float() for s in samples])
    return RolloutTensors(tokens, lengths, mask, rollout_lp, advantages.float())


def collate_share(share: SampleShare, pad_id: int = 0) -> RolloutTensors:
    """:func:`collate` of samples that arrived as flat tensors (:class:`SampleShare`)."""
    tokens, lengths, mask = pad_pairs(share.split_prompts(), share.split_responses(), pad_id)
    rollout_lp = torch.zeros(mask.shape, dtype=torch.float32)
    rollout_lp[mask] = share.logprobs.float()
    return RolloutTensors(tokens, lengths, mask, rollout_lp, share.advantages.float())


def reference_logprobs(policy, data: RolloutTensors, micro_batch_size: int) -> torch.Tensor:
    """[N, S-1] float32 log-probs of ``data``'s tokens under ``policy``'s frozen reference weights
    (:meth:`~sparrow_nemo.policy.policy.MegatronPolicy.reference_logprobs`; collective over the ranks)."""
    batches = micro_batches(data.tokens, data.lengths, {}, micro_batch_size)
    return concat_outputs(policy.reference_logprobs(batches)).logprobs.detach().float()


def token_mismatch(
    samples: Sequence[RolloutSample], dense: LogprobOutput, data: RolloutTensors
) -> TokenMismatch:
    """Per response token: acceptance rate between the policy's dense top-K and the engine's sparse top-K.

    Args:
        samples: the rollouts (engine top-K per token); dense: the policy's outputs [N, S-1, ...] for
            ``data`` (same rows, same padding).

    Returns:
        :class:`TokenMismatch` over all response tokens, sample-major (the order of ``samples``).
    """
    mask = data.response_mask
    k = min(dense.topk_ids.shape[-1], samples[0].top_ids.shape[-1])
    q_ids = torch.cat([s.top_ids[:, :k] for s in samples])
    q_lp = torch.cat([s.top_logprobs[:, :k].float() for s in samples])
    alpha = acceptance_rate_topk(dense.topk_ids[mask][:, :k], dense.topk_logprobs[mask][:, :k], q_ids, q_lp)
    return TokenMismatch(
        alpha=alpha.float(),
        cached_len=torch.cat([s.cached_len for s in samples]).to(torch.int64),
        train_logprobs=dense.logprobs.detach()[mask].float(),
        gen_logprobs=data.rollout_logprobs[mask],
    )
