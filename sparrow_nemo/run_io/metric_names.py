"""Our metric names beside NeMo-RL's and verl's: ``logging.metric_aliases: nemo_rl | verl`` writes both.

The map is the documentation (``docs/metrics.md`` prints it): each entry is ``our name -> their name``, only for
quantities that are the same (a name of theirs for something we compute differently is left out). The alias is
written in the same row (JSONL, TensorBoard, W&B) next to ours, never instead of it, and never over a name we
write ourselves.
"""

from __future__ import annotations

from collections.abc import Mapping

#: our name -> NeMo-RL's (nemo_rl/algorithms/grpo.py: the timing/train/* and train/* keys it logs)
NEMO_RL: dict[str, str] = {
    "timing/rollout": "timing/train/generation",
    "timing/reward": "timing/train/reward_calculation",
    "timing/logprobs": "timing/train/policy_and_reference_logprobs",
    "timing/update": "timing/train/policy_training",
    "timing/refit": "timing/train/prepare_for_generation",
    "timing/checkpoint": "timing/train/checkpointing",
    "timing/step": "timing/train/total_step_time",
    "reward/mean": "train/reward",
    "response_length/mean": "train/mean_gen_tokens_per_sample",
    "token_mult_prob_error": "train/token_mult_prob_error",
    "train/loss": "train/loss",
    "train/grad_norm": "train/grad_norm",
    "train/clip_fraction": "train/probs_ratio_clamped_fraction",
    "train/kl": "train/kl_penalty",
}
#: our name -> verl's (verl/trainer/ppo/metric_utils.py and the actor's metrics)
VERL: dict[str, str] = {
    "timing/rollout": "timing_s/gen",
    "timing/reward": "timing_s/reward",
    "timing/logprobs": "timing_s/old_log_prob",
    "timing/reference": "timing_s/ref",
    "timing/update": "timing_s/update_actor",
    "timing/refit": "timing_s/update_weights",
    "timing/checkpoint": "timing_s/save_checkpoint",
    "timing/step": "timing_s/step",
    "reward/mean": "critic/score/mean",
    "response_length/mean": "response_length/mean",
    "response_length/max": "response_length/max",
    "response_length/min": "response_length/min",
    "response_length/truncation_rate": "response_length/clip_ratio",
    "train/loss": "actor/pg_loss",
    "train/grad_norm": "actor/grad_norm",
    "train/clip_fraction": "actor/pg_clipfrac",
    "train/entropy": "actor/entropy",
    "train/kl": "actor/kl_loss",
    "dynamic_sampling/rounds": "train/num_gen_batches",  # its DAPO recipe's filter_groups
}
ALIASES: dict[str, dict[str, str]] = {"nemo_rl": NEMO_RL, "verl": VERL}


def with_aliases(metrics: Mapping[str, float], flavour: str | None) -> dict[str, float]:
    """``metrics`` plus the ``flavour``'s names of the ones it maps (None: ``metrics`` unchanged)."""
    out = dict(metrics)
    if flavour is None:
        return out
    for ours, theirs in ALIASES[flavour].items():
        if ours in metrics and theirs not in metrics:
            out[theirs] = metrics[ours]
    return out


def repeat_tag(tag: str, pair: int) -> str:
    """The evaluation tag of ``tag``'s ``pair``-th timing repeat: ``tag`` itself for pair 0, else
    ``<tag>_repeat_<pair>`` (the state's ``evals`` and the ``eval/<tag>/...`` metrics use it)."""
    return tag if pair == 0 else f"{tag}_repeat_{pair}"
