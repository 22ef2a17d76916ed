"""``sparrow plan``: the parallel layout and per-GPU memory plan of a recipe on a given cluster."""

from __future__ import annotations

import argparse
import sys

from sparrow_nemo.commands._common import add_config_arguments, config_from_args

NAME = "plan"
HELP = "show the tensor/pipeline/data-parallel layout and per-GPU memory plan of a recipe"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=1, help="nodes in the job (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument(
        "--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU, GiB (default 80: H100)"
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from sparrow_nemo.policy.parallel import LayoutError
    from sparrow_nemo.policy.plan import format_plan, plan

    config = config_from_args(args)
    policy = config.policy
    try:
        report = plan(
            config.model.shape(),
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            tp=policy.tensor_model_parallel_size,
            pp=policy.pipeline_model_parallel_size,
            micro_batch=policy.micro_batch_size,
            seq_len=config.data.max_prompt_tokens + config.rollout.max_new_tokens,
            dtype=policy.precision,
            optimizer="distributed_adam" if policy.optimizer.distributed else "adam",
            gpu_memory_gb=args.gpu_memory_gb,
            shape_name=config.model.preset or "custom",
            recompute=policy.activation_recompute,
        )
    except LayoutError as exc:
        print(f"sparrow plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(report))
    return 0
