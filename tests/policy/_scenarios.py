"""Worker bodies for the multi-process policy tests (module level, so spawn can pickle them)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.batch import PolicyBatch
from sparrow_nemo.policy.hf_import import export_hf_state_dict, load_hf_into_model
from sparrow_nemo.policy.logprobs import LogprobOutput
from sparrow_nemo.policy.memory import DEFAULT_MEMORY, MemorySettings
from sparrow_nemo.policy.model import build_model
from sparrow_nemo.policy.optim import OptimizerSettings
from sparrow_nemo.policy.parallel import ParallelLayout, destroy_parallel, initialize_parallel
from sparrow_nemo.policy.policy import MegatronPolicy

SETTINGS = OptimizerSettings(lr=1e-2, eps=1e-3, weight_decay=0.1, grad_clip=0.5)
NUM_MICRO = 4


def make_batches(vocab: int, n: int = NUM_MICRO, b: int = 2, s: int = 12, seed: int = 7) -> list[PolicyBatch]:
    """``n`` micro-batches [b, s] with unequal lengths, right padding and a per-row advantage."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(4, s + 1, (b,), generator=g)
        tokens = torch.randint(0, vocab, (b, s), generator=g)
        tokens[torch.arange(s).unsqueeze(0) >= lengths.unsqueeze(1)] = 0
        out.append(PolicyBatch(tokens, lengths, {"adv": torch.randn(b, generator=g)}))
    return out


def pg_loss(out: LogprobOutput, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """A GRPO-shaped loss: -adv * logprob (token mean) minus an entropy bonus."""
    mask = batch.target_mask().float()
    adv = batch.extras["adv"].unsqueeze(1)
    n = mask.sum()
    loss = -(adv * out.logprobs * mask).sum() / n - 0.01 * (out.entropy * mask).sum() / n
    return loss, {"entropy": float((out.entropy.detach() * mask).sum() / n)}


def _setup(
    tp: int, pp: int, tied: bool, ckpt: str | None, memory: MemorySettings = DEFAULT_MEMORY
) -> MegatronPolicy:
    shape = PRESETS["tiny-test"].replace(tie_word_embeddings=tied)
    layout = ParallelLayout.for_world(int(os.environ.get("WORLD_SIZE", "1")), tp=tp, pp=pp)
    return MegatronPolicy(shape, layout, SETTINGS, "float32", hf_dir=ckpt, memory=memory)


def _my_batches(batches: list[PolicyBatch], layout: ParallelLayout) -> list[PolicyBatch]:
    from megatron.core import parallel_state as ps

    per = len(batches) // layout.dp
    r = ps.get_data_parallel_rank()
    return batches[r * per : (r + 1) * per]


def train_once(
    rank: int, tp: int, pp: int, tied: bool, ckpt: str, out_file: str, memory: MemorySettings = DEFAULT_MEMORY
) -> None:
    """Logprobs, one train step over NUM_MICRO micro-batches (split over DP), logprobs again, export."""
    policy = _setup(tp, pp, tied, ckpt, memory)
    batches = make_batches(policy.spec.shape.vocab_size)
    before = policy.logprobs(batches[:2])
    result = policy.train_step(_my_batches(batches, policy.spec.layout), pg_loss)
    after = policy.logprobs(batches[:2])
    weights = policy.export_hf()
    if rank == 0:
        torch.save(
            {
                "before": before,
                "after": after,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "metrics": result.metrics,
                "weights": weights,
                "numel": sum(p.numel() for p in policy.model.parameters()),
                "layout": policy.spec.layout,
            },
            out_file,
        )
    policy.close()


def two_rank_suite(rank: int, jobs: list[tuple]) -> None:
    """Run several jobs in one 2-process world (saves the interpreter start-up per job).

    Each job is ``(function name in this module, MASTER_PORT, args)``; the process group is rebuilt per job.
    """
    for name, port, args in jobs:
        os.environ["MASTER_PORT"] = str(port)
        globals()[name](rank, *args)


def logprobs_tp(rank: int, logits: torch.Tensor, targets: torch.Tensor, vocab: int, out_dir: str) -> None:
    """Vocab-parallel outputs and the gradient of (logprob + entropy) for this rank's logits shard."""
    import torch.distributed as dist

    from sparrow_nemo.policy.logprobs import vocab_parallel_logprobs
    from sparrow_nemo.policy.parallel import init_distributed

    init_distributed("gloo")
    world = dist.get_world_size()
    shard = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    out = vocab_parallel_logprobs(shard, targets, vocab, top_k=5, tp_group=dist.group.WORLD)
    (out.logprobs.sum() + 0.5 * out.entropy.sum()).backward()
    torch.save({"out": out.detach(), "grad": shard.grad}, Path(out_dir) / f"lp_rank{rank}.pt")
    dist.destroy_process_group()


def chunked_head_tp(
    rank: int, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, out_dir: str
) -> None:
    """The fused chunked head on this rank's weight shard: outputs and the gradients of (logprob + entropy)."""
    import torch.distributed as dist

    from sparrow_nemo.policy.logprobs import chunked_head_logprobs
    from sparrow_nemo.policy.parallel import init_distributed

    init_distributed("gloo")
    world = dist.get_world_size()
    h = hidden.clone().requires_grad_(True)
    shard = weight.chunk(world, dim=0)[rank].clone().requires_grad_(True)
    out = chunked_head_logprobs(h, shard, targets, vocab, chunk=3, top_k=5, tp_group=dist.group.WORLD)
    (out.logprobs.sum() + 0.5 * out.entropy.sum()).backward()
    saved = {"out": out.detach(), "grad_hidden": h.grad, "grad_weight": shard.grad}
    torch.save(saved, Path(out_dir) / f"head_rank{rank}.pt")
    dist.destroy_process_group()


def roundtrip(rank: int, tp: int, pp: int, tied: bool, ckpt: str, out_file: str) -> None:
    """Import the HF checkpoint into this layout and export it straight back."""
    shape = PRESETS["tiny-test"].replace(tie_word_embeddings=tied)
    layout = ParallelLayout.for_world(int(os.environ["WORLD_SIZE"]), tp=tp, pp=pp)
    initialize_parallel(layout, shape)
    model, spec = build_model(shape, layout)
    load_hf_into_model(model, spec, ckpt)
    weights = export_hf_state_dict(model, spec)
    torch.save(weights, f"{out_file}.rank{rank}")
    destroy_parallel()


def train_save_crash(rank: int, tp: int, pp: int, ckpt: str, root: str, out_file: str) -> None:
    """Step 1, save, step 2 (recorded), then die while saving step 2 (shards written, no manifest)."""
    from sparrow_nemo.policy import checkpoint as policy_checkpoint

    policy = _setup(tp, pp, False, ckpt)
    batches = make_batches(policy.spec.shape.vocab_size, n=2 * NUM_MICRO, seed=11)
    policy.train_step(_my_batches(batches[:NUM_MICRO], policy.spec.layout), pg_loss)
    policy.save(root, 1)
    result = policy.train_step(_my_batches(batches[NUM_MICRO:], policy.spec.layout), pg_loss)
    weights = policy.export_hf()
    if rank == 0:
        torch.save({"loss": result.loss, "grad_norm": result.grad_norm, "weights": weights}, out_file)
    original = policy_checkpoint.atomic_torch_save

    def save_then_die(obj, path):
        original(obj, path)
        os._exit(0)  # killed after this rank's shard, before the barrier and the manifest

    policy_checkpoint.atomic_torch_save = save_then_die
    policy.save(root, 2)


def resume_and_step(rank: int, tp: int, pp: int, root: str, out_file: str) -> None:
    """A fresh process: random init, resume from the latest complete checkpoint, run step 2."""
    from sparrow_nemo.checkpoint.atomic import latest_checkpoint

    policy = _setup(tp, pp, False, None)
    latest = latest_checkpoint(root)
    step = policy.load(latest)
    batches = make_batches(policy.spec.shape.vocab_size, n=2 * NUM_MICRO, seed=11)
    result = policy.train_step(_my_batches(batches[NUM_MICRO:], policy.spec.layout), pg_loss)
    weights = policy.export_hf()
    if rank == 0:
        torch.save(
            {
                "step": step,
                "latest": Path(latest).name,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "weights": weights,
            },
            out_file,
        )
    policy.close()
