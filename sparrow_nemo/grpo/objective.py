"""The GRPO policy objective as the policy worker's ``loss_fn(outputs, batch)`` (and the warm-start's SFT one).

Each :class:`~sparrow_nemo.policy.batch.PolicyBatch` carries in ``extras`` (all [b, S-1] unless noted):
``mask`` (bool, response tokens), ``old_logprobs`` (dense policy before the update), ``rollout_logprobs``
(sparse engine), ``advantages`` ([b]) and, when ``grpo.loss.kl_coef > 0``, ``ref_logprobs`` (the frozen
reference policy, :meth:`MegatronPolicy.reference_logprobs`).
"""

from __future__ import annotations

from sparrow_nemo.grpo.losses import PolicyLossConfig, compute_policy_loss, masked_mean
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.schedule import LossFn


def grpo_loss_fn(config: PolicyLossConfig) -> LossFn:
    """``loss_fn`` for :meth:`MegatronPolicy.train_step`: the registered policy loss on the batch's extras.

    Metrics: the loss's own (clip_fraction, ratio_*, token_mult_prob_error, ``kl`` when ``kl_coef > 0``,
    ...) plus ``entropy`` (mean over response tokens, nats).
    """

    def loss_fn(out: LogprobOutput, batch: PolicyBatch):
        x = batch.extras
        mask = x["mask"].to(out.logprobs.device)
        loss, metrics = compute_policy_loss(
            config,
            out.logprobs,
            x["old_logprobs"].to(out.logprobs.device),
            x["advantages"].to(out.logprobs.device),
            mask,
            rollout_logprobs=x["rollout_logprobs"].to(out.logprobs.device),
            ref_logprobs=x["ref_logprobs"].to(out.logprobs.device) if "ref_logprobs" in x else None,
        )
        metrics["entropy"] = masked_mean(out.entropy.detach(), mask.float()).item()
        return loss, metrics

    return loss_fn


def sft_loss_fn(out: LogprobOutput, batch: PolicyBatch):
    """Mean negative log-likelihood of the tokens marked by ``extras['mask']`` [b, S-1] (the solutions)."""
    mask = batch.extras["mask"].to(out.logprobs.device).float()
    loss = -masked_mean(out.logprobs, mask)
    return loss, {"nll": loss.item()}
