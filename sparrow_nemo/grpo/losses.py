"""Policy-gradient losses for GRPO with rollout/train mismatch correction (verl / NeMo-RL vocabulary).

Two small registries:

- policy losses (``@register_policy_loss``): ``"clipped_pg"``, the PPO/GRPO clipped surrogate with separate
  ``clip_low`` / ``clip_high`` (DAPO's clip-higher; the paper uses 0.2 / 0.28);
- rollout corrections (``@register_correction``), which turn the train/rollout log-ratio of the *sampled*
  tokens into a per-token weight: ``"none"``, ``"tis"`` (truncated importance sampling),
  ``"icepop"`` (token masking outside [low, high]) and ``"seq_mask"`` (mask whole sequences whose
  geometric-mean ratio is outside [low, high]).

Shapes: every logprob tensor is ``[B, T]`` float (log-probability of the sampled token at each response
position, natural log), ``mask`` is ``[B, T]`` bool/0-1 (True = a response token that counts),
``advantages`` is ``[B]`` (one per sequence) or ``[B, T]``.

Which logprobs are which:

- ``logprobs``: the policy being trained (carries the gradient);
- ``old_logprobs``: the same training engine (dense attention) before this update; the PPO ratio is
  ``exp(logprobs - old_logprobs)``;
- ``rollout_logprobs``: what the rollout engine (sparse attention) reported when sampling; the mismatch
  ratio is ``exp(old_logprobs - rollout_logprobs)`` (detached), as in TIS (Yao et al., 2025) and verl;
- ``ref_logprobs``: the frozen reference model, for the optional k3 KL penalty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sparrow_nemo.config.schema import NON_NEGATIVE, POSITIVE, Section, interval, knob, one_of_names

AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


@dataclass(frozen=True)
class PolicyLossConfig(Section):
    """Options of the policy loss: the recipe's ``grpo.loss`` section."""

    name: str = knob(
        "clipped_pg",
        "registered policy loss (register_policy_loss)",
        check=one_of_names(lambda: policy_loss_names()),
    )
    clip_low: float = knob(
        0.2, "PPO ratio lower clip: ratio >= 1 - clip_low", check=interval(0, 1, hi_open=True)
    )
    clip_high: float = knob(
        0.28, "PPO ratio upper clip: ratio <= 1 + clip_high (DAPO clip-higher)", check=NON_NEGATIVE
    )
    aggregation: str = knob(
        "token_mean",
        "token_mean (sum over the batch's valid tokens / their number; the paper) or seq_mean_token_mean "
        "(mean over sequences of each sequence's token mean)",
        check=one_of_names(lambda: AGGREGATIONS),
    )
    kl_coef: float = knob(
        0.0,
        "weight of the k3 KL to the frozen reference policy (the initial weights); 0 = none",
        check=NON_NEGATIVE,
    )
    correction: str = knob(
        "tis",
        "registered rollout/train mismatch correction (register_correction): none, tis, icepop, seq_mask",
        check=one_of_names(lambda: correction_names()),
    )
    tis_cap: float = knob(2.0, "truncated importance sampling: weight = min(ratio, tis_cap)", check=POSITIVE)
    icepop_low: float = knob(
        0.5, "icepop: tokens whose train/rollout ratio is below this are masked", check=NON_NEGATIVE
    )
    icepop_high: float = knob(
        5.0, "icepop: tokens whose train/rollout ratio is above this are masked", check=POSITIVE
    )
    seq_mask_low: float = knob(
        0.95, "seq_mask: sequences whose geometric-mean ratio is below this are masked", check=NON_NEGATIVE
    )
    seq_mask_high: float = knob(
        1.05, "seq_mask: sequences whose geometric-mean ratio is above this are masked", check=POSITIVE
    )

    def check(self) -> None:
        if self.clip_high < self.clip_low:
            raise self.invalid("clip_high", f">= clip_low ({self.clip_low:g})")
        for what in ("icepop", "seq_mask"):
            low, high = getattr(self, f"{what}_low"), getattr(self, f"{what}_high")
            if high <= low:
                raise self.invalid(f"{what}_high", f"> {what}_low ({low:g})")


LossFn = Callable[..., tuple[Tensor, dict[str, float]]]
CorrectionFn = Callable[[Tensor, Tensor, PolicyLossConfig], tuple[Tensor, dict[str, float]]]

_LOSSES: dict[str, LossFn] = {}
_CORRECTIONS: dict[str, CorrectionFn] = {}


def _register(table: dict, kind: str, name: str) -> Callable:
    def decorator(fn: Callable) -> Callable:
        if name in table:
            raise ValueError(f"{kind} '{name}' is already registered")
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict, kind: str, name: str) -> Callable:
    if name not in table:
        raise KeyError(f"unknown {kind} '{name}'; known: {', '.join(sorted(table))}")
    return table[name]


def register_policy_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: register ``fn(logprobs, old_logprobs, advantages, mask, config, rollout_logprobs,
    ref_logprobs) -> (loss, metrics)`` under ``name``."""
    return _register(_LOSSES, "policy loss", name)


def register_correction(name: str) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator: register ``fn(log_ratio [B, T], mask [B, T] float, config) -> (weight [B, T], metrics)``
    under ``name``; ``log_ratio`` = old (train) logprob - rollout logprob, detached."""
    return _register(_CORRECTIONS, "rollout correction", name)


def policy_loss_names() -> list[str]:
    """Names of the registered policy losses, sorted."""
    return sorted(_LOSSES)


def correction_names() -> list[str]:
    """Names of the registered rollout corrections, sorted."""
    return sorted(_CORRECTIONS)


def get_policy_loss(name: str) -> LossFn:
    """The policy loss registered as ``name``."""
    return _lookup(_LOSSES, "policy loss", name)


def get_correction(name: str) -> CorrectionFn:
    """The rollout correction registered as ``name``."""
    return _lookup(_CORRECTIONS, "rollout correction", name)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` (same shape, 0/1 float) is 1; 0 when none are."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(per_token: Tensor, mask: Tensor, aggregation: str) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar over the valid tokens of ``mask`` [B, T] (0/1 float).

    "token_mean": sum over all valid tokens / their count. "seq_mean_token_mean": each sequence's mean over
    its valid tokens, then the mean over the sequences that have any valid token.
    """
    if aggregation == "token_mean":
        return masked_mean(per_token, mask)
    if aggregation == "seq_mean_token_mean":
        counts = mask.sum(dim=1)
        has_tokens = counts > 0
        seq_means = (per_token * mask).sum(dim=1) / counts.clamp(min=1.0)
        return seq_means[has_tokens].mean()
    raise ValueError(f"unknown aggregation '{aggregation}'; known: {', '.join(AGGREGATIONS)}")


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || ref) on sampled tokens: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def _check_inputs(
    logprobs: Tensor, mask: Tensor, advantages: Tensor, **others: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Validate the shapes; returns (mask as float [B, T], advantages broadcast to [B, T])."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    for name, t in {"mask": mask, **others}.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(t.shape)}")
    if advantages.shape == shape[:1]:
        advantages = advantages.unsqueeze(1).expand(shape)
    elif advantages.shape != shape:
        raise ValueError(
            f"advantages must be [B]={tuple(shape[:1])} or [B, T]={tuple(shape)}, got {tuple(advantages.shape)}"
        )
    maskf = mask.to(logprobs.dtype)
    if maskf.sum() == 0:
        raise ValueError("mask selects no token: the policy loss needs at least one response token")
    return maskf, advantages.to(logprobs.dtype)


@register_correction("none")
def no_correction(
    log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, float]]:
    """Weight 1 everywhere (the rollout is treated as on-policy)."""
    return torch.ones_like(log_ratio), {}


@register_correction("tis")
def truncated_is(
    log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance sampling: weight = min(exp(log_ratio), tis_cap)."""
    ratio = torch.exp(log_ratio)
    clipped = ratio > config.tis_cap
    weight = ratio.clamp(max=config.tis_cap)
    return weight, {"tis_clipped_fraction": masked_mean(clipped.to(mask.dtype), mask).item()}


@register_correction("icepop")
def icepop_mask(log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """IcePop: weight 1 where icepop_low <= exp(log_ratio) <= icepop_high, else 0 (token masked)."""
    ratio = torch.exp(log_ratio)
    keep = (ratio >= config.icepop_low) & (ratio <= config.icepop_high)
    weight = keep.to(mask.dtype)
    return weight, {"masked_fraction": masked_mean(1.0 - weight, mask).item()}


@register_correction("seq_mask")
def sequence_mask(
    log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, float]]:
    """Mask every token of a sequence whose geometric-mean ratio exp(mean_t log_ratio) over its valid tokens
    is outside [seq_mask_low, seq_mask_high]."""
    mean_log = (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    geo = torch.exp(mean_log)
    keep = (geo >= config.seq_mask_low) & (geo <= config.seq_mask_high)
    weight = keep.to(mask.dtype).unsqueeze(1).expand_as(log_ratio)
    return weight, {"masked_fraction": masked_mean(1.0 - weight, mask).item()}


@register_policy_loss("clipped_pg")
def clipped_pg_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: PolicyLossConfig,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate, per token ``w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) + kl_coef * k3``.

    ``r = exp(logprobs - old_logprobs)``; ``w`` is the rollout-correction weight computed from
    ``old_logprobs - rollout_logprobs`` (detached; 1 when ``rollout_logprobs`` is None). Returns the scalar
    loss (differentiable in ``logprobs``) and metrics (python floats over the valid tokens): clip_fraction,
    ratio_mean/max/min, rollout_ratio_mean, token_mult_prob_error (NeMo-RL: mean exp|old - rollout|),
    kl, and the correction's own metrics.
    """
    maskf, adv = _check_inputs(
        logprobs,
        mask,
        advantages,
        old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs,
        ref_logprobs=ref_logprobs,
    )
    valid = maskf.bool()
    ratio = torch.exp(logprobs - old_logprobs.detach())
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(surr, surr_clipped)

    metrics: dict[str, float] = {
        "clip_fraction": masked_mean((surr_clipped > surr).to(maskf.dtype), maskf).item(),
        "ratio_mean": masked_mean(ratio.detach(), maskf).item(),
        "ratio_max": ratio.detach()[valid].max().item(),
        "ratio_min": ratio.detach()[valid].min().item(),
    }
    if rollout_logprobs is not None:
        log_ratio = (old_logprobs - rollout_logprobs).detach()
        weight, correction_metrics = get_correction(config.correction)(log_ratio, maskf, config)
        per_token = per_token * weight
        metrics.update(correction_metrics)
        metrics["rollout_ratio_mean"] = masked_mean(torch.exp(log_ratio), maskf).item()
        metrics["token_mult_prob_error"] = masked_mean(torch.exp(log_ratio.abs()), maskf).item()
    if config.kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("PolicyLossConfig.kl_coef > 0 needs ref_logprobs [B, T]; got None")
        kl = k3_kl(logprobs, ref_logprobs.detach())
        per_token = per_token + config.kl_coef * kl
        metrics["kl"] = masked_mean(kl.detach(), maskf).item()
    loss = aggregate(per_token, maskf, config.aggregation)
    metrics["loss"] = loss.item()
    return loss, metrics


def compute_policy_loss(
    config: PolicyLossConfig,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Dispatch to the policy loss ``config.name`` (shapes as in the module docstring)."""
    return get_policy_loss(config.name)(
        logprobs, old_logprobs, advantages, mask, config, rollout_logprobs, ref_logprobs
    )
