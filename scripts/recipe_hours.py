"""Predicted wall-clock hours of the cluster recipes on their documented clusters (the README's Cluster table).

    .venv/bin/python scripts/recipe_hours.py                 # every recipes/qwen3_*.yaml model recipe
    .venv/bin/python scripts/recipe_hours.py qwen3_8b_math --mfu 0.3 --hardware h200

A cost-model estimate, not a measurement. Assumptions (each a knob or stated in the output):

- cluster: the recipe's ``# cluster: <N> node(s) x <G> GPUs`` line (checked by tests/slurm/test_recipes_plan.py);
- rollout: one engine per tensor-parallel group (world / tp engines), each decoding an equal share of the
  step's ``prompts_per_step x samples_per_prompt`` responses as one batch, priced by
  :class:`sparrow_nemo.sparse.cost_model.DecodeCostModel` on ``tp`` GPUs (tp x the FLOP/s and bandwidth:
  tensor parallelism splits the weights and the KV heads);
- responses: lengths spread evenly from 1,024 tokens to ``rollout.max_new_tokens`` (mean about half the
  cap); prompts of ``data.max_prompt_tokens / 4`` tokens;
- training: 5 forward-pass equivalents per token (dense logprobs 1, forward 1, backward 2, full recompute 1)
  = 10 x non-embedding parameters FLOPs per token, plus causal attention 5 x 2 x S^2 x Hq x D per layer
  and sequence, at ``--mfu`` of the peak over all GPUs;
- weight refit, rewards and logging are left out.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import torch

from sparrow_nemo.commands.plan import CLUSTER_LINE, documented_cluster
from sparrow_nemo.config import recipes_dir
from sparrow_nemo.grpo.recipe import SparrowConfig, load_config
from sparrow_nemo.sparse.cost_model import HARDWARE, DecodeCostModel, Hardware
from sparrow_nemo.sparse.schedule import BudgetSchedule

#: passes of training work per token in units of one forward pass
TRAIN_PASSES = 5
MIN_RESPONSE = 1024


def response_lengths(config: SparrowConfig, count: int) -> torch.Tensor:
    """[count] int64 response lengths, tokens: evenly spread over [MIN_RESPONSE, rollout.max_new_tokens]."""
    top = config.rollout.max_new_tokens
    return torch.linspace(min(MIN_RESPONSE, top), top, count).round().to(torch.int64)


@dataclass(frozen=True)
class StepEstimate:
    """Seconds of one RL step."""

    rollout_s: float
    train_s: float

    @property
    def total_s(self) -> float:
        return self.rollout_s + self.train_s


def step_estimate(
    config: SparrowConfig, gpus: int, hardware: Hardware, mfu: float, schedule: BudgetSchedule
) -> StepEstimate:
    """One RL step of ``config`` on ``gpus`` GPUs of ``hardware`` under rollout ``schedule``."""
    shape, tp = config.model.shape(), config.policy.tensor_model_parallel_size
    engines = gpus // tp
    responses = config.grpo.prompts_per_step * config.grpo.samples_per_prompt
    prompt = config.data.max_prompt_tokens // 4
    per_engine = response_lengths(config, -(-responses // engines))
    group = replace(hardware, peak_flops=hardware.peak_flops * tp, mem_bandwidth=hardware.mem_bandwidth * tp)
    model = DecodeCostModel(shape, group, dense_layers=config.sparsity.dense_layers)
    rollout_s = model.rollout_cost(schedule, per_engine, prompt).total_s

    seq = (response_lengths(config, responses) + prompt).to(torch.float64)
    dense_flops = 2 * shape.non_embedding_parameters() * float(seq.sum())
    attn_flops = 2 * shape.num_layers * shape.num_attention_heads * shape.head_dim * float((seq**2).sum())
    train_s = TRAIN_PASSES * (dense_flops + attn_flops) / (gpus * hardware.peak_flops * mfu)
    return StepEstimate(rollout_s, train_s)


def _table(names: list[str], hardware: Hardware, mfu: float) -> str:
    rows = [
        "| recipe | cluster | step, sparse / dense (min) | rollout speedup | hours for max_steps, sparse / dense |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        path = recipes_dir() / f"{name}.yaml"
        config = load_config(path)
        nodes, per_node, _ = documented_cluster(path)
        gpus = nodes * per_node
        schedule = config.sparsity.build_schedule()
        dense = BudgetSchedule.dense(schedule.bin_tokens, schedule.page_size)
        sparse_step = step_estimate(config, gpus, hardware, mfu, schedule)
        dense_step = step_estimate(config, gpus, hardware, mfu, dense)
        steps = config.trainer.max_steps
        rows.append(
            f"| {name} | {nodes} x {per_node} {hardware.name.upper()} | {sparse_step.total_s / 60:.1f} / "
            f"{dense_step.total_s / 60:.1f} | {dense_step.rollout_s / sparse_step.rollout_s:.2f}x | "
            f"{steps * sparse_step.total_s / 3600:.0f} / {steps * dense_step.total_s / 3600:.0f} ({steps} steps) |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", help="recipe names (default: every qwen3_* model recipe)")
    parser.add_argument("--hardware", default="h100", choices=sorted(HARDWARE), help="GPU constants")
    parser.add_argument("--mfu", type=float, default=0.4, help="training model-FLOPs utilisation (0, 1]")
    args = parser.parse_args(argv)
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu must lie in (0, 1], got {args.mfu}")
    names = args.recipes or sorted(
        p.stem for p in recipes_dir().glob("qwen3_*.yaml") if CLUSTER_LINE.search(p.read_text())
    )
    print(_table(names, HARDWARE[args.hardware], args.mfu))
    print(
        f"\nwall-clock hours; cost model on {args.hardware} constants, training at MFU {args.mfu:g}, response lengths "
        f"spread evenly from {MIN_RESPONSE} tokens to the cap (scripts/recipe_hours.py states every assumption)"
    )


if __name__ == "__main__":
    main()
