"""Worker bodies for the update-phase tests: one GRPO update of a fixed step batch, its loss and gradient.

Module level, so ``spawn`` can pickle them. The gradient is read after the optimizer step with clipping off
(``grad_clip=0``): the torch branch leaves the synced (DP-summed, unclipped) gradient in ``param.grad``.
"""

from __future__ import annotations

import os

import torch

from sparrow_nemo.grpo.losses import PolicyLossConfig, compute_policy_loss
from sparrow_nemo.grpo.update import UpdateBatch, mini_batch_order, update_policy
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.hf_import import export_hf_state_dict
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.packing import micro_batches
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy

SHAPE = PRESETS["tiny-test"]
#: no clipping, so the gradient after the step is the raw step gradient
NO_CLIP = OptimizerSettings(lr=1e-2, eps=1e-3, weight_decay=0.1, grad_clip=0.0)
ROWS, WIDTH, PROMPT = 8, 14, 3


def step_batch(seed: int = 3) -> UpdateBatch:
    """8 sequences of 3 prompt tokens + 1..10 response tokens (very unequal counts), right-padded to 14.

    ``old_logprobs`` scatter around the random-init model's ~ -log(vocab), so PPO ratios range over ~[0.5, 2]
    (both clip sides act); ``ref_logprobs`` likewise (the KL term is non-zero).
    """
    g = torch.Generator().manual_seed(seed)
    responses = torch.tensor([1, 10, 2, 7, 1, 4, 9, 3])
    lengths = PROMPT + responses
    tokens = torch.randint(3, SHAPE.vocab_size, (ROWS, WIDTH), generator=g)
    tokens[torch.arange(WIDTH).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
    cols = torch.arange(WIDTH - 1).unsqueeze(0)
    mask = (cols >= PROMPT - 1) & (cols < (lengths - 1).unsqueeze(1))
    base = -torch.log(torch.tensor(float(SHAPE.vocab_size)))

    def around(scale: float) -> torch.Tensor:
        return (base + scale * torch.randn(ROWS, WIDTH - 1, generator=g)) * mask

    return UpdateBatch(
        tokens=tokens,
        lengths=lengths,
        response_mask=mask,
        advantages=torch.randn(ROWS, generator=g),
        rollout_logprobs=around(0.3),
        old_logprobs=around(0.5),
        ref_logprobs=around(0.5),
    )


def replica_share(step: UpdateBatch, dp: int, dp_rank: int, mini_batches: int) -> UpdateBatch:
    """DP rank ``dp_rank``'s rows of ``step`` as the trainer holds and orders them: a contiguous block
    (``RankPlan.replica_prompts``, one row per group here) in :func:`mini_batch_order`."""
    per = len(step) // dp
    block = step.rows(slice(dp_rank * per, (dp_rank + 1) * per))
    return block.rows(mini_batch_order(per, 1, mini_batches))


def exported_grads(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    """This step's gradient in HF names, whole, on every rank (the weights' export run on ``param.grad``)."""
    params = list(policy.model.parameters())
    saved = [p.data for p in params]
    with torch.no_grad():
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        try:
            return export_hf_state_dict(policy.model, policy.spec)
        finally:
            for p, data in zip(params, saved, strict=True):
                p.data = data


def update_once(
    rank: int,
    tp: int,
    pp: int,
    micro: int,
    ckpt: str,
    loss: PolicyLossConfig,
    out_file: str,
    mini_batches: int = 1,
) -> None:
    """One GRPO update (``update_policy``) of :func:`step_batch` split over this layout's DP ranks."""
    layout = ParallelLayout.for_world(int(os.environ.get("WORLD_SIZE", "1")), tp=tp, pp=pp)
    policy = MegatronPolicy(SHAPE, layout, NO_CLIP, "float32", hf_dir=ckpt)
    from megatron.core import parallel_state as ps

    step = step_batch()
    share = replica_share(step, layout.dp, ps.get_data_parallel_rank(), mini_batches)
    result = update_policy(policy, share, loss, micro, mini_batches)
    grads = exported_grads(policy)
    if rank == 0:
        torch.save({"metrics": result.metrics, "grads": grads, "updated": result.updated}, out_file)
    policy.close()


def per_micro_batch_mean_loss(
    rank: int, micro: int, ckpt: str, loss: PolicyLossConfig, out_file: str
) -> None:
    """The old normalisation, for contrast: each micro-batch's own token mean, averaged over micro-batches."""
    policy = MegatronPolicy(SHAPE, ParallelLayout.for_world(1), NO_CLIP, "float32", hf_dir=ckpt)
    step = step_batch()
    extras = {
        "mask": step.response_mask,
        "old": step.old_logprobs,
        "rollout": step.rollout_logprobs,
        "ref": step.ref_logprobs,
        "adv": step.advantages,
    }

    def local_mean(out, batch):
        x = batch.extras
        return compute_policy_loss(loss, out.logprobs, x["old"], x["adv"], x["mask"], x["rollout"], x["ref"])

    result = policy.train_step(micro_batches(step.tokens, step.lengths, extras, micro), local_mean, "mean")
    torch.save({"loss": result.loss, "grads": exported_grads(policy)}, out_file)
    policy.close()


def two_rank_suite(rank: int, jobs: list[tuple]) -> None:
    """Several jobs in one 2-process world; each job is ``(function name, MASTER_PORT, args)``."""
    for name, port, args in jobs:
        os.environ["MASTER_PORT"] = str(port)
        globals()[name](rank, *args)
