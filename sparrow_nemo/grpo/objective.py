"""The GRPO policy objective as the policy worker's ``loss_fn(outputs, batch)`` (and the warm-start's SFT one).

Each :class:`~sparrow_nemo.policy.batch.PolicyBatch` carries in ``extras`` (all [b, S-1] unless noted):
``mask`` (bool, response tokens), ``old_logprobs`` (dense policy before the step's first update),
``rollout_logprobs`` (sparse engine), ``advantages`` ([b]) and, when ``grpo.loss.kl_coef > 0``,
``ref_logprobs`` (the frozen reference policy, :meth:`MegatronPolicy.reference_logprobs`).
"""

from __future__ import annotations

import torch

from sparrow_nemo.grpo.losses import LossNormalizer, PolicyLossConfig, compute_policy_loss, masked_mean
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.pipeline import LossFn


def grpo_loss_fn(config: PolicyLossConfig, normalizer: LossNormalizer) -> LossFn:
    """``loss_fn`` for ``MegatronPolicy.train_step(..., reduction="sum")``: the registered policy loss on the
    batch's extras, as this micro-batch's share of an optimizer step with the counts ``normalizer``.

    Metrics (shares too, summed by ``train_step`` into the step's values): the loss's own (clip_fraction,
    ratio_*, token_mult_prob_error, ``kl`` when ``kl_coef > 0``, ...) plus ``entropy`` (token mean, nats).
    """

    def loss_fn(out: LogprobOutput, batch: PolicyBatch):
        x = batch.extras
        device = out.logprobs.device
        mask = x["mask"].to(device)
        loss, metrics = compute_policy_loss(
            config,
            out.logprobs,
            x["old_logprobs"].to(device),
            x["advantages"].to(device),
            mask,
            rollout_logprobs=x["rollout_logprobs"].to(device),
            ref_logprobs=x["ref_logprobs"].to(device) if "ref_logprobs" in x else None,
            normalizer=normalizer,
        )
        entropy = torch.where(mask.bool(), out.entropy.detach(), 0.0).sum() / normalizer.tokens
        metrics["entropy"] = entropy.item()
        return loss, metrics

    return loss_fn


def sft_loss_fn(out: LogprobOutput, batch: PolicyBatch):
    """Mean negative log-likelihood of the tokens marked by ``extras['mask']`` [b, S-1] (the solutions)."""
    mask = batch.extras["mask"].to(out.logprobs.device).float()
    loss = -masked_mean(out.logprobs, mask)
    return loss, {"nll": loss.item()}
