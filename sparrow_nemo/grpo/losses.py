"""Policy-gradient losses for GRPO with rollout/train mismatch correction (verl / NeMo-RL vocabulary).

Three small registries:

- policy losses (``@register_policy_loss``): ``"clipped_pg"``, the PPO/GRPO clipped surrogate with separate
  ``clip_low`` / ``clip_high`` (DAPO's clip-higher; the paper uses 0.2 / 0.28). A policy loss returns
  per-token terms (:class:`LossTerms`); the aggregation turns them into the scalar;
- rollout corrections (``@register_correction``), which turn the train/rollout ratio ``rho = exp(old -
  rollout)`` of the *sampled* tokens into a per-token weight (each function's docstring cites its source):
  ``"none"``; ``"tis"`` truncated IS, ``min(rho, tis_cap)``; ``"mis"`` masked IS, ``rho`` where
  ``rho <= mis_cap`` else 0; ``"icepop"``, ``rho`` inside ``[icepop_low, icepop_high]`` else 0;
  ``"seq_mask"``, weight 1 for sequences whose geometric-mean ratio is inside ``[seq_mask_low,
  seq_mask_high]``, else 0; ``"seq_mask_tis"``, that sequence mask times the token TIS weight;
- aggregations (``@register_aggregation``, :data:`AGGREGATIONS`), per-token loss -> scalar:
  ``"token_mean"`` (the paper's token-level loss), ``"seq_mean_token_mean"``, ``"seq_mean_token_sum"``.

Normalisation (what makes the loss independent of micro-batch size, data-parallel size and pipeline
schedule): an aggregation divides by the counts of the whole *optimizer step* - every micro-batch of
every data-parallel rank - given as a :class:`LossNormalizer` (verl's ``global_batch_num_tokens``,
NeMo-RL's ``global_valid_toks`` / ``global_valid_seqs``). The loss of one micro-batch is then its share
of the step's loss, and the step's loss is the plain sum of the shares (:mod:`sparrow_nemo.grpo.update`).
Without a normalizer the counts of the given tensors are used (a self-contained mean, as in the tests).
Metrics follow the same rule: each is the micro-batch's share of the step's token mean, except
``ratio_max`` / ``ratio_min`` (reduced by max / min).

Shapes: every logprob tensor is ``[B, T]`` float (log-probability of the sampled token at each response
position, natural log), ``mask`` is ``[B, T]`` bool/0-1 (True = a response token that counts),
``advantages`` is ``[B]`` (one per sequence) or ``[B, T]``.

Which logprobs are which:

- ``logprobs``: the policy being trained (carries the gradient);
- ``old_logprobs``: the same training engine (dense attention) before this step's first update; the PPO
  ratio is ``exp(logprobs - old_logprobs)`` (exactly 1 in the first mini-batch of a step, real after);
- ``rollout_logprobs``: what the rollout engine (sparse attention) reported when sampling; the mismatch
  ratio is ``exp(old_logprobs - rollout_logprobs)`` (detached), as in TIS (Yao et al., 2025) and verl;
- ``ref_logprobs``: the frozen reference model, for the optional k3 KL penalty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sparrow_nemo.config.schema import NON_NEGATIVE, POSITIVE, Section, interval, knob, one_of_names


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
        "registered aggregation (register_aggregation), each normalised by the optimizer step's counts over all "
        "micro-batches and DP ranks: token_mean (token-level, the paper: valid tokens' sum / the step's token "
        "count), seq_mean_token_mean (each sequence's token mean, summed / the step's sequence count), "
        "seq_mean_token_sum (valid tokens' sum / the step's sequence count)",
        check=one_of_names(lambda: AGGREGATIONS),
    )
    kl_coef: float = knob(
        0.0,
        "weight of the k3 KL to the frozen reference policy (the initial weights); 0 = none",
        check=NON_NEGATIVE,
    )
    correction: str = knob(
        "tis",
        "registered rollout/train mismatch correction (register_correction): none, tis, mis, icepop, seq_mask, "
        "seq_mask_tis (grpo/losses.py cites each one's source)",
        check=one_of_names(lambda: correction_names()),
    )
    tis_cap: float = knob(
        2.0,
        "tis / seq_mask_tis: token weight = min(ratio, tis_cap) (verl's rollout_is_threshold)",
        check=POSITIVE,
    )
    mis_cap: float = knob(
        2.0,
        "mis: tokens whose train/rollout ratio is above this get weight 0, the others the ratio",
        check=POSITIVE,
    )
    icepop_low: float = knob(
        0.5,
        "icepop: tokens whose train/rollout ratio is below this are masked (IcePop's alpha)",
        check=NON_NEGATIVE,
    )
    icepop_high: float = knob(
        5.0,
        "icepop: tokens whose train/rollout ratio is above this are masked (IcePop's beta)",
        check=POSITIVE,
    )
    seq_mask_low: float = knob(
        0.95,
        "seq_mask / seq_mask_tis: sequences whose geometric-mean ratio is below this are masked",
        check=NON_NEGATIVE,
    )
    seq_mask_high: float = knob(
        1.05,
        "seq_mask / seq_mask_tis: sequences whose geometric-mean ratio is above this are masked",
        check=POSITIVE,
    )

    def check(self) -> None:
        if self.clip_high < self.clip_low:
            raise self.invalid("clip_high", f">= clip_low ({self.clip_low:g})")
        for what in ("icepop", "seq_mask"):
            low, high = getattr(self, f"{what}_low"), getattr(self, f"{what}_high")
            if high <= low:
                raise self.invalid(f"{what}_high", f"> {what}_low ({low:g})")


@dataclass(frozen=True)
class LossNormalizer:
    """The denominators of one optimizer step's loss, counted over all its micro-batches and DP ranks.

    Attributes:
        tokens: response tokens (mask entries) of the step; the token-mean denominator.
        sequences: sequences of the step with at least one response token; the sequence-mean denominator.
    """

    tokens: float
    sequences: float

    @classmethod
    def of(cls, mask: Tensor) -> LossNormalizer:
        """The counts of ``mask`` [B, T] alone (a self-contained mean over this batch)."""
        counts = mask.sum(dim=1)
        return cls(tokens=float(counts.sum()), sequences=float((counts > 0).sum()))


@dataclass
class LossTerms:
    """What a policy loss computes per token, before aggregation.

    Attributes:
        per_token: [B, T] loss of each token (differentiable in ``logprobs``; masked tokens arbitrary).
        token_stats: metric name -> [B, T] detached per-token values whose token mean is the metric.
        ratio: [B, T] detached PPO ratio (for ``ratio_max`` / ``ratio_min``).
    """

    per_token: Tensor
    token_stats: dict[str, Tensor] = field(default_factory=dict)
    ratio: Tensor | None = None


PolicyLossFn = Callable[..., LossTerms]
CorrectionFn = Callable[[Tensor, Tensor, PolicyLossConfig], tuple[Tensor, dict[str, Tensor]]]
AggregationFn = Callable[[Tensor, Tensor, LossNormalizer], Tensor]

_LOSSES: dict[str, PolicyLossFn] = {}
_CORRECTIONS: dict[str, CorrectionFn] = {}
#: aggregation name -> ``fn(per_token [B, T], mask [B, T] float, normalizer) -> scalar``
AGGREGATIONS: dict[str, AggregationFn] = {}


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


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register ``fn(logprobs, old_logprobs, advantages, mask, config, rollout_logprobs,
    ref_logprobs) -> LossTerms`` under ``name`` (inputs already validated: mask float, advantages [B, T])."""
    return _register(_LOSSES, "policy loss", name)


def register_correction(name: str) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator: register ``fn(log_ratio [B, T], mask [B, T] float, config) -> (weight [B, T], per-token
    metric tensors [B, T])`` under ``name``; ``log_ratio`` = old (train) logprob - rollout logprob, detached."""
    return _register(_CORRECTIONS, "rollout correction", name)


def policy_loss_names() -> list[str]:
    """Names of the registered policy losses, sorted."""
    return sorted(_LOSSES)


def correction_names() -> list[str]:
    """Names of the registered rollout corrections, sorted."""
    return sorted(_CORRECTIONS)


def register_aggregation(name: str) -> Callable[[AggregationFn], AggregationFn]:
    """Decorator: register ``fn(per_token [B, T], mask [B, T] float, normalizer) -> scalar`` under ``name``."""
    return _register(AGGREGATIONS, "loss aggregation", name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``."""
    return _lookup(_LOSSES, "policy loss", name)


def get_correction(name: str) -> CorrectionFn:
    """The rollout correction registered as ``name``."""
    return _lookup(_CORRECTIONS, "rollout correction", name)


def get_aggregation(name: str) -> AggregationFn:
    """The loss aggregation registered as ``name``."""
    return _lookup(AGGREGATIONS, "loss aggregation", name)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` (same shape, 0/1 float) is 1; 0 when none are."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


@register_aggregation("token_mean")
def token_mean(per_token: Tensor, mask: Tensor, normalizer: LossNormalizer) -> Tensor:
    """Sum over the valid tokens / the step's token count (token-level loss: the paper, DAPO, verl's default)."""
    return (per_token * mask).sum() / normalizer.tokens


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(per_token: Tensor, mask: Tensor, normalizer: LossNormalizer) -> Tensor:
    """Each sequence's mean over its valid tokens, summed / the step's sequence count (GRPO's original)."""
    seq_means = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return seq_means.sum() / normalizer.sequences


@register_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(per_token: Tensor, mask: Tensor, normalizer: LossNormalizer) -> Tensor:
    """Sum over the valid tokens / the step's sequence count (verl's ``seq-mean-token-sum``)."""
    return (per_token * mask).sum() / normalizer.sequences


def aggregate(
    per_token: Tensor, mask: Tensor, aggregation: str, normalizer: LossNormalizer | None = None
) -> Tensor:
    """Reduce a per-token loss [B, T] over the valid tokens of ``mask`` [B, T] (0/1 float) to a scalar.

    ``normalizer``: the optimizer step's counts (the result is this batch's share of the step's loss);
    None = this batch's own counts.
    """
    return get_aggregation(aggregation)(per_token, mask, normalizer or LossNormalizer.of(mask))


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
    return mask.to(logprobs.dtype), advantages.to(logprobs.dtype)


@register_correction("none")
def no_correction(
    log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weight 1 everywhere (the rollout is treated as on-policy)."""
    return torch.ones_like(log_ratio), {}


@register_correction("tis")
def truncated_is(
    log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling, token level: weight = min(rho, tis_cap).

    Source: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (2025), TIS;
    verl ``algorithm.rollout_correction.rollout_is: token`` with ``rollout_is_threshold``."""
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=config.tis_cap)
    return weight, {"tis_clipped_fraction": (ratio > config.tis_cap).to(mask.dtype)}


@register_correction("mis")
def masked_is(log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked importance sampling, token level: weight = rho where rho <= mis_cap, else 0 (the token is dropped
    instead of truncated).

    Source: the same authors' MIS (Yao et al. 2025, follow-up "When speed kills stability"); verl's token-level
    rejection sampling (``rollout_rs: token`` with ``rollout_is: token``)."""
    ratio = torch.exp(log_ratio)
    keep = ratio <= config.mis_cap
    return torch.where(keep, ratio, 0.0), {"masked_fraction": (~keep).to(mask.dtype)}


@register_correction("icepop")
def icepop_mask(
    log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """IcePop: weight = rho where icepop_low <= rho <= icepop_high, else 0 (the token's gradient is masked).

    Source: IcePop, Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking
    Model" (Ring-1T, 2025), the masking function M(k) = k on [alpha, beta], 0 outside; alpha 0.5, beta 5."""
    ratio = torch.exp(log_ratio)
    keep = (ratio >= config.icepop_low) & (ratio <= config.icepop_high)
    return torch.where(keep, ratio, 0.0), {"masked_fraction": (~keep).to(mask.dtype)}


def _sequence_keep(log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig) -> Tensor:
    """[B, T] 0/1: 1 on every token of a sequence whose geometric-mean ratio exp(mean_t log_ratio) over its
    valid tokens is inside [seq_mask_low, seq_mask_high]."""
    mean_log = (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    geo = torch.exp(mean_log)
    keep = (geo >= config.seq_mask_low) & (geo <= config.seq_mask_high)
    return keep.to(mask.dtype).unsqueeze(1).expand_as(log_ratio)


@register_correction("seq_mask")
def sequence_mask(
    log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mask every token of a sequence whose geometric-mean ratio is outside [seq_mask_low, seq_mask_high]
    (weight 1 otherwise).

    Source: verl's geometric sequence rejection sampling (``rollout_rs: geometric``); DeepSeek-V3.2's
    off-policy sequence masking is the same idea on the sequence's KL."""
    weight = _sequence_keep(log_ratio, mask, config)
    return weight, {"masked_fraction": 1.0 - weight}


@register_correction("seq_mask_tis")
def sequence_mask_tis(
    log_ratio: Tensor, mask: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """The sequence mask of ``seq_mask`` times the token TIS weight min(rho, tis_cap).

    Source: NeMo-RL's ``seq-mask-tis`` token-level loss correction (a geometric-mean sequence mask with
    truncated token importance weights)."""
    keep = _sequence_keep(log_ratio, mask, config)
    ratio = torch.exp(log_ratio)
    return keep * ratio.clamp(max=config.tis_cap), {
        "masked_fraction": 1.0 - keep,
        "tis_clipped_fraction": (ratio > config.tis_cap).to(mask.dtype),
    }


@register_policy_loss("clipped_pg")
def clipped_pg_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: PolicyLossConfig,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> LossTerms:
    """Clipped surrogate, per token ``w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) + kl_coef * k3``.

    ``r = exp(logprobs - old_logprobs)``; ``w`` is the rollout-correction weight computed from
    ``old_logprobs - rollout_logprobs`` (detached; 1 when ``rollout_logprobs`` is None). Per-token stats:
    clip_fraction, ratio_mean, rollout_ratio_mean, token_mult_prob_error (NeMo-RL: mean exp|old - rollout|),
    kl, and the correction's own.
    """
    ratio = torch.exp(logprobs - old_logprobs.detach())
    surr = -advantages * ratio
    surr_clipped = -advantages * ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(surr, surr_clipped)
    stats = {
        "clip_fraction": (surr_clipped > surr).to(mask.dtype),
        "ratio_mean": ratio.detach(),
    }
    if rollout_logprobs is not None:
        log_ratio = (old_logprobs - rollout_logprobs).detach()
        weight, correction_stats = get_correction(config.correction)(log_ratio, mask, config)
        per_token = per_token * weight
        stats.update(correction_stats)
        stats["rollout_ratio_mean"] = torch.exp(log_ratio)
        stats["token_mult_prob_error"] = torch.exp(log_ratio.abs())
    if config.kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("PolicyLossConfig.kl_coef > 0 needs ref_logprobs [B, T]; got None")
        kl = k3_kl(logprobs, ref_logprobs.detach())
        per_token = per_token + config.kl_coef * kl
        stats["kl"] = kl.detach()
    return LossTerms(per_token=per_token, token_stats=stats, ratio=ratio.detach())


def token_metrics(terms: LossTerms, mask: Tensor, tokens: float) -> dict[str, float]:
    """``sum over valid tokens / tokens`` of every per-token stat, plus ``ratio_max`` / ``ratio_min``.

    With ``tokens`` = this batch's own count these are means; with the step's count, shares of the step's
    means. Max / min of an empty mask are -inf / inf (the identities of their reductions).
    """
    valid = mask.bool()  # where(), not a product: a masked prompt column may hold an inf stat
    metrics = {
        name: float(torch.where(valid, value, 0.0).sum() / tokens)
        for name, value in terms.token_stats.items()
    }
    if terms.ratio is not None:
        any_valid = bool(valid.any())
        metrics["ratio_max"] = float(terms.ratio[valid].max()) if any_valid else float("-inf")
        metrics["ratio_min"] = float(terms.ratio[valid].min()) if any_valid else float("inf")
    return metrics


def compute_policy_loss(
    config: PolicyLossConfig,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    normalizer: LossNormalizer | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss ``config.name`` aggregated by ``config.aggregation`` (shapes: module docstring).

    Args:
        normalizer: the optimizer step's counts; the loss and metrics are then this batch's shares (a batch
            without valid tokens gives 0). None: this batch's own counts (it must have a valid token).

    Returns:
        (scalar loss, differentiable in ``logprobs``; metrics as python floats, ``loss`` included).
    """
    maskf, adv = _check_inputs(
        logprobs,
        mask,
        advantages,
        old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs,
        ref_logprobs=ref_logprobs,
    )
    if normalizer is None:
        if maskf.sum() == 0:
            raise ValueError("mask selects no token: the policy loss needs at least one response token")
        normalizer = LossNormalizer.of(maskf)
    terms = get_policy_loss(config.name)(
        logprobs, old_logprobs, adv, maskf, config, rollout_logprobs, ref_logprobs
    )
    loss = aggregate(terms.per_token, maskf, config.aggregation, normalizer)
    metrics = token_metrics(terms, maskf, normalizer.tokens)
    metrics["loss"] = loss.item()
    return loss, metrics
