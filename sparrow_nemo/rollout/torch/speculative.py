"""Lossless sparse rollout: sparse self-speculative decoding (sparse draft, dense verify).

The sparse rule drafts ``k`` tokens (the same model, attention within the draft's KV budget), one dense
forward of the ``k + 1`` positions verifies them, and the standard speculative-sampling rule keeps a prefix:
draft token ``d_j ~ q_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; the first rejected one
is replaced by a sample of ``normalise(max(0, p_j - q_j))``; when all ``k`` pass, one more token is drawn from
the dense ``p_k``. The emitted tokens are then distributed exactly as dense decoding's (Leviathan et al.
2023, Chen et al. 2023), and ``sum_v min(p, q)`` - the paper's acceptance rate - is the probability that a
draft token is accepted (METHOD.md, last section).

``p`` and ``q`` here are the distributions the tokens are sampled from: softmax of the logits at the
sampling temperature, restricted by top-k / top-p exactly as :func:`sparrow_nemo.rollout.sampling.sample_tokens`
restricts them and renormalised; with temperature 0 both are one-hot at the argmax (lowest id on ties), so
the rule reduces to "accept while the draft equals the dense argmax, then emit the dense argmax".

This module holds the rule as pure functions on tensors and :class:`SpeculativeConfig`, what
``TorchRolloutEngine.generate(..., speculative=...)`` takes; the decode loop is
:mod:`sparrow_nemo.rollout.torch.spec_decode`, the dense verify forward :mod:`sparrow_nemo.rollout.torch.extend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.sampling import kept_probs, sample_from, sampling_probs
from sparrow_nemo.sparse.schedule import BudgetSchedule

__all__ = ["SpeculativeConfig", "Verdict", "verify_drafts"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """How ``generate`` speculates.

    Attributes:
        draft_tokens: k, the draft tokens per verify, one value per bin of cached length (the draft schedule's
            bins; the last value holds for longer contexts). 0 in a bin means plain dense decoding there (one
            dense step per token). One value = the same k at every length.
        draft_schedule: the draft's KV budget per bin (the sparse rule's schedule); None = the schedule passed
            to ``generate``.
    """

    draft_tokens: tuple[int, ...] = (4,)
    draft_schedule: BudgetSchedule | None = None

    def __post_init__(self) -> None:
        ks = tuple(int(k) for k in self.draft_tokens)
        object.__setattr__(self, "draft_tokens", ks)
        if not ks or min(ks) < 0:
            raise ValueError(f"SpeculativeConfig.draft_tokens must be non-empty and >= 0 per bin, got {ks}")

    @property
    def max_draft_tokens(self) -> int:
        """The largest k of any bin."""
        return max(self.draft_tokens)

    def schedule_for(self, schedule: BudgetSchedule) -> BudgetSchedule:
        """The draft's schedule when ``generate`` was given ``schedule``."""
        return schedule if self.draft_schedule is None else self.draft_schedule

    def k_for(self, cached_len: torch.Tensor, bin_tokens: int) -> torch.Tensor:
        """k per row: ``cached_len [B]`` int (tokens in the cache when the first draft token is sampled) ->
        [B] int64, from the bin ``cached_len // bin_tokens`` (clamped to the last bin)."""
        table = torch.tensor(self.draft_tokens, dtype=torch.int64, device=cached_len.device)
        return table[torch.clamp(cached_len.to(torch.int64) // bin_tokens, max=table.numel() - 1)]

    def to_dict(self) -> dict:
        """Plain data (for logs and checkpoints)."""
        return {
            "draft_tokens": list(self.draft_tokens),
            "draft_schedule": None if self.draft_schedule is None else self.draft_schedule.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        """Inverse of :meth:`to_dict`."""
        schedule = data.get("draft_schedule")
        return cls(
            draft_tokens=tuple(data["draft_tokens"]),
            draft_schedule=None if schedule is None else BudgetSchedule.from_dict(schedule),
        )


#: float64 elements of p (and as many of q) that :func:`verify_drafts` forms at once: at batch 64 and a
#: 151,936-token vocabulary that is one draft position at a time (78 MB each), at the tiny CPU shapes all of them
PROBS_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verify pass (B rows, K = the most draft tokens of any row).

    Attributes:
        accepted: [B] int64 leading draft tokens kept.
        next_token: [B] int64 the token after them (the resampled first rejection, or the bonus token).
        alpha: [B, K] float64 ``sum_v min(p_j, q_j)`` per draft position (garbage past a row's k).
        tested: [B, K] bool positions whose acceptance test ran (the accepted ones and the first rejection).
    """

    accepted: torch.Tensor
    next_token: torch.Tensor
    alpha: torch.Tensor
    tested: torch.Tensor


def verify_drafts(
    dense_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    sampling: SamplingParams,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> Verdict:
    """The speculative-sampling acceptance rule for a batch of rows with their own draft lengths.

    Args:
        dense_logits: [B, K + 1, V] fp32; entry j is the dense next-token logits after the row's j-th fed
            token (the pending token, then the drafts), i.e. the target for draft j and, at j = k, the bonus.
        draft_logits: [B, K, V] fp32; entry j is the logits draft token j was sampled from.
        drafts: [B, K] int64 draft tokens; num_drafts: [B] int64 k per row (0 <= k <= K).
        sampling: temperature / top-k / top-p (applied to p and q alike, :func:`sampling_probs`).
        accept_uniforms: [B, K] U[0, 1) per draft position (zeros when greedy);
        final_uniforms: [B, K + 1] U[0, 1) for the token emitted after j accepted drafts, j = 0 .. K (the
            resampled rejection at j, or the bonus at j = k); zeros when greedy.

    Returns:
        :class:`Verdict`. Draft j is accepted iff every earlier one was and ``u_j * q_j(d_j) < p_j(d_j)``.
    """
    batch, width = drafts.shape
    device = dense_logits.device
    alpha = torch.zeros(batch, width, dtype=torch.float64, device=device)
    ok = torch.zeros(batch, width, dtype=torch.bool, device=device)
    step = max(1, PROBS_ELEMENTS // max(1, batch * dense_logits.shape[-1]))  # positions per chunk
    for j in range(0, width, step):  # every position of a chunk at once: no per-position loop at small V
        e = min(j + step, width)
        p = sampling_probs(dense_logits[:, j:e], sampling)  # [B, e - j, V]
        q = sampling_probs(draft_logits[:, j:e], sampling)
        alpha[:, j:e] = torch.minimum(p, q).sum(dim=-1)
        d = drafts[:, j:e, None]
        ok[:, j:e] = accept_uniforms[:, j:e].to(device) * q.gather(2, d)[..., 0] < p.gather(2, d)[..., 0]
    in_run = torch.arange(width, device=device)[None, :] < num_drafts[:, None]
    passed = torch.cumprod((ok & in_run).to(torch.int64), dim=1)  # 1 while every draft so far passed
    accepted = passed.sum(dim=1)
    tested = in_run & (torch.arange(width, device=device)[None, :] <= accepted[:, None])
    rows = torch.arange(batch, device=device)
    rejected = accepted < num_drafts  # the first rejection is at position `accepted`
    at = torch.clamp(accepted, max=max(width - 1, 0))
    u_final = final_uniforms.to(device).gather(1, accepted[:, None])[:, 0]  # the emitted token's position
    next_token = torch.zeros(batch, dtype=torch.int64, device=device)
    if bool(rejected.any()):
        r = rows[rejected]
        p = sampling_probs(dense_logits[r, at[r]], sampling)
        residual = torch.clamp(p - sampling_probs(draft_logits[r, at[r]], sampling), min=0.0)
        next_token[r] = sample_from(residual, u_final[r])
    bonus = ~rejected  # every draft accepted: one more token from the dense distribution after the last
    if bool(bonus.any()):
        r = rows[bonus]
        next_token[r] = sample_from(kept_probs(dense_logits[r, num_drafts[r]], sampling), u_final[r])
    return Verdict(accepted=accepted, next_token=next_token, alpha=alpha, tested=tested)
