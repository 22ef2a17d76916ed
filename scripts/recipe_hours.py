"""Predicted wall-clock hours of the cluster recipes on their documented clusters (the README's Cluster table).

    .venv/bin/python scripts/recipe_hours.py                 # every recipes/qwen3_*.yaml model recipe
    .venv/bin/python scripts/recipe_hours.py qwen3_8b_math --mfu 0.3 --gpu h200

A prediction, not a measurement. Assumptions (each a knob or stated in the output):

- cluster: the recipe's ``# cluster: <N> node(s) x <G> GPUs`` line (checked by tests/slurm/test_recipes_plan.py);
- rollout: the engine's own scheduler in dry mode on the slowest engine of the step, in the KV pool
  ``sparrow plan`` gives it, priced by the decode cost model on the GPU's constants
  (:mod:`sparrow_nemo.commands._forecast` states its assumptions: Qwen3-like response lengths, prompts of
  ``data.max_prompt_tokens / 4`` tokens, engines of ``rollout.tensor_parallel_size`` GPUs);
- training: 5 forward-pass equivalents per token (dense logprobs 1, forward 1, backward 2, full recompute 1)
  = 10 x non-embedding parameters FLOPs per token, plus causal attention 5 x 2 x S^2 x Hq x D per layer
  and sequence, at ``--mfu`` of the peak over all GPUs, over the same response lengths;
- weight refit, rewards and logging are left out.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from sparrow_nemo.commands._forecast import GPU_MEMORY_GIB, RolloutForecast, rollout_forecast
from sparrow_nemo.commands.plan import CLUSTER_LINE, documented_cluster, plan_config
from sparrow_nemo.config import recipes_dir
from sparrow_nemo.grpo.recipe import SparrowConfig, load_config
from sparrow_nemo.rollout.torch.dry_run import qwen3_lengths
from sparrow_nemo.sparse.cost_model import HARDWARE

#: passes of training work per token in units of one forward pass
TRAIN_PASSES = 5


@dataclass(frozen=True)
class StepEstimate:
    """Seconds of one RL step, sparse and dense rollout, and the forecast behind them."""

    rollout_s: float
    dense_rollout_s: float
    train_s: float
    forecast: RolloutForecast

    @property
    def total_s(self) -> float:
        return self.rollout_s + self.train_s

    @property
    def dense_total_s(self) -> float:
        return self.dense_rollout_s + self.train_s


def train_seconds(
    config: SparrowConfig, gpus: int, peak_flops: float, mfu: float, lengths: list[int]
) -> float:
    """Seconds of a step's training work on ``gpus`` GPUs for responses of ``lengths`` tokens."""
    shape = config.model.shape()
    seq = torch.tensor(lengths, dtype=torch.float64) + config.data.max_prompt_tokens // 4
    dense_flops = 2 * shape.non_embedding_parameters() * float(seq.sum())
    attn_flops = 2 * shape.num_layers * shape.num_attention_heads * shape.head_dim * float((seq**2).sum())
    return TRAIN_PASSES * (dense_flops + attn_flops) / (gpus * peak_flops * mfu)


def step_estimate(
    config: SparrowConfig, nodes: int, gpus_per_node: int, gpu: str, mfu: float
) -> StepEstimate:
    """One RL step of ``config`` on ``nodes x gpus_per_node`` GPUs of kind ``gpu`` (h100, h200)."""
    gpus = nodes * gpus_per_node
    report = plan_config(config, nodes, gpus_per_node, GPU_MEMORY_GIB[gpu])
    g = config.grpo
    engines = gpus // config.rollout.tensor_parallel_size
    count = -(-g.prompts_per_step // engines) * engines * g.samples_per_prompt
    lengths = qwen3_lengths(count, config.rollout.max_new_tokens)
    forecast = rollout_forecast(config, report.rollout.pool_tokens, gpus, HARDWARE[gpu], lengths)
    trained = lengths[: g.prompts_per_step * g.samples_per_prompt]
    train_s = train_seconds(config, gpus, HARDWARE[gpu].peak_flops, mfu, trained)
    return StepEstimate(forecast.continuous.seconds, forecast.dense.seconds, train_s, forecast)


def _table(names: list[str], gpu: str, mfu: float) -> str:
    rows = [
        "| recipe | cluster | step, sparse / dense (min) | rollout speedup | hours for max_steps, sparse / dense |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        path = recipes_dir() / f"{name}.yaml"
        nodes, per_node, _ = documented_cluster(path)
        step = step_estimate(load_config(path), nodes, per_node, gpu, mfu)
        steps = load_config(path).trainer.max_steps
        rows.append(
            f"| {name} | {nodes} x {per_node} {gpu.upper()} | {step.total_s / 60:.1f} / {step.dense_total_s / 60:.1f} | "
            f"{step.dense_rollout_s / step.rollout_s:.2f}x | {steps * step.total_s / 3600:.0f} / "
            f"{steps * step.dense_total_s / 3600:.0f} ({steps} steps) |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", help="recipe names (default: every qwen3_* model recipe)")
    parser.add_argument("--gpu", default="h100", choices=sorted(GPU_MEMORY_GIB), help="GPU kind")
    parser.add_argument("--mfu", type=float, default=0.4, help="training model-FLOPs utilisation (0, 1]")
    args = parser.parse_args(argv)
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu must lie in (0, 1], got {args.mfu}")
    names = args.recipes or sorted(
        p.stem for p in recipes_dir().glob("qwen3_*.yaml") if CLUSTER_LINE.search(p.read_text())
    )
    print(_table(names, args.gpu, args.mfu))
    print(
        f"\nwall-clock hours; rollout from the engine's scheduler in dry mode on {args.gpu} constants, training at "
        f"MFU {args.mfu:g}, Qwen3-like response lengths (scripts/recipe_hours.py states every assumption)"
    )


if __name__ == "__main__":
    main()
