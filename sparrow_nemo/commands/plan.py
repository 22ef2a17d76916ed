"""``sparrow plan``: the parallel layout and per-GPU memory plan of a recipe on a given cluster.

``sparrow plan --table`` prints the memory table of docs/memory.md instead: every shipped ``qwen3_*`` model recipe
on the cluster its ``# cluster:`` line documents.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from sparrow_nemo.commands._common import add_config_arguments, config_from_args
from sparrow_nemo.commands._forecast import GPU_MEMORY_GIB

NAME = "plan"
HELP = "show the tensor/pipeline/data-parallel layout and per-GPU memory plan of a recipe"

#: the cluster a model recipe documents: ``# cluster: <N> node(s) x <G> GPUs (80 GB H100) - <submit>``
CLUSTER_LINE = re.compile(
    r"^# cluster: (?P<nodes>\d+) nodes? x (?P<gpus>\d+) GPUs \(80 GB H100\) - (?P<submit>.*)$", re.M
)
#: memory of the documented clusters' GPUs, GiB (80 GB H100)
DOCUMENTED_GPU_GIB = 80.0


def documented_cluster(recipe: Path) -> tuple[int, int, str]:
    """(nodes, GPUs per node, how to submit) from the recipe's ``# cluster:`` comment line."""
    match = CLUSTER_LINE.search(recipe.read_text())
    if match is None:
        raise ValueError(f"{recipe}: no '# cluster: N nodes x G GPUs (80 GB H100) - <submit>' line")
    return int(match["nodes"]), int(match["gpus"]), match["submit"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=1, help="nodes in the job (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument(
        "--gpu",
        default="h100",
        choices=sorted(GPU_MEMORY_GIB),
        help="the GPU kind: its memory and the cost-model constants of the rollout forecast (default h100)",
    )
    parser.add_argument(
        "--gpu-memory-gb", type=float, default=None, help="memory of one GPU, GiB (default: the --gpu kind's)"
    )
    parser.add_argument(
        "--lengths-from",
        type=Path,
        default=None,
        help="a finished run's metrics.jsonl: forecast with its response lengths (default: a Qwen3-like mix)",
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="the memory table of docs/memory.md: every shipped qwen3_* recipe on its documented cluster",
    )
    add_config_arguments(parser)


def plan_config(config, nodes: int, gpus_per_node: int, gpu_memory_gb: float):
    """:class:`~sparrow_nemo.policy.plan.PlanReport` of a resolved recipe (LayoutError when it cannot run)."""
    from sparrow_nemo.policy.engine_memory import RolloutSpec
    from sparrow_nemo.policy.lora import LoraConfig
    from sparrow_nemo.policy.memory import MemorySettings
    from sparrow_nemo.policy.plan import DistillSpec, plan

    policy, d = config.policy, config.distill
    distill = None
    if d.enabled:
        targets = LoraConfig.from_hf_targets(d.lora_rank, d.lora_alpha, d.target_modules).targets
        distill = DistillSpec(
            d.lora_rank,
            targets,
            config.sparsity.dense_layers,
            config.sparsity.page_size,
            config.sparsity.page_score,
        )
    return plan(
        config.model.shape(),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        tp=policy.tensor_model_parallel_size,
        pp=policy.pipeline_model_parallel_size,
        micro_batch=policy.micro_batch_size,
        seq_len=config.data.max_prompt_tokens + config.rollout.max_new_tokens,
        dtype=policy.precision,
        optimizer="distributed_adam" if policy.optimizer.distributed else "adam",
        gpu_memory_gb=gpu_memory_gb,
        shape_name=config.model.preset or "custom",
        memory=MemorySettings.from_policy_config(policy),
        distill=distill,
        rollout=RolloutSpec(
            config.rollout.backend,
            config.rollout.max_batch_size,
            config.model.dtype,
            config.sparsity.page_size,
            config.sparsity.dense_layers,
            config.sparsity.page_score,
            config.rollout.tensor_parallel_size,
            config.rollout.kv_cache_fraction,
            config.rollout.max_cache_tokens,
        ),
        offload_during_rollout=policy.offload_during_rollout,
    )


def recipes_table() -> str:
    """Markdown table: per shipped model recipe, the plan's per-GPU GiB on its documented cluster (training
    phase, then the rollout phase: the policy's and the engine's weights, the KV pool; the optimizer state the
    offload keeps in each node's host memory)."""
    from sparrow_nemo.config import recipes_dir
    from sparrow_nemo.grpo.recipe import load_config
    from sparrow_nemo.policy.plan import GIB

    rows = [
        "| recipe | nodes x GPUs | layout | weights | grads | optimizer | activations | recompute | logits "
        "| distill | total GiB/GPU | rollout: policy + engine weights GiB | rollout KV GiB (sequences) "
        "| host GiB/node |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(recipes_dir().glob("qwen3_*.yaml")):
        if not CLUSTER_LINE.search(path.read_text()):
            continue
        nodes, gpus, _ = documented_cluster(path)
        r = plan_config(load_config(path), nodes, gpus, DOCUMENTED_GPU_GIB)
        m, lay = r.memory, r.layout
        distill = "-" if r.distill is None else f"{(r.distill.total - m.total) / GIB:.1f}"
        kv, beside = "-", "-"
        if r.rollout is not None:
            kv = f"{r.rollout.kv_pool / GIB:.1f} ({r.rollout.sequences})"
            beside = f"{r.rollout_policy / GIB:.1f} + {r.rollout.engine_weights / GIB:.1f}"
        host = f"{gpus * r.host_offload / GIB:.1f}" if r.host_offload else "-"
        rows.append(
            f"| `{path.stem}` | {nodes} x {gpus} | TP{lay.tp} PP{lay.pp} DP{lay.dp} | {m.weights / GIB:.1f} | "
            f"{m.gradients / GIB:.1f} | {m.optimizer / GIB:.1f} | {m.activations / GIB:.1f} | "
            f"{m.recompute / GIB:.1f} | {m.logits / GIB:.1f} | {distill} | {r.peak.total / GIB:.1f} | {beside} | "
            f"{kv} | {host} |"
        )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    from sparrow_nemo.commands._forecast import rollout_forecast
    from sparrow_nemo.policy.parallel import LayoutError
    from sparrow_nemo.policy.plan import format_plan
    from sparrow_nemo.rollout.torch.dry_run import lengths_like_run
    from sparrow_nemo.sparse.cost_model import HARDWARE

    try:
        if args.table:
            print(recipes_table())
            return 0
        config = config_from_args(args)
        memory = args.gpu_memory_gb or GPU_MEMORY_GIB[args.gpu]
        report = plan_config(config, args.nodes, args.gpus_per_node, memory)
    except LayoutError as exc:
        print(f"sparrow plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(report))
    if report.rollout is not None:
        gpus = args.nodes * args.gpus_per_node
        lengths = None
        if args.lengths_from is not None:
            engines = gpus // config.rollout.tensor_parallel_size
            count = -(-config.grpo.prompts_per_step // engines) * engines * config.grpo.samples_per_prompt
            lengths = lengths_like_run(args.lengths_from, count, config.rollout.max_new_tokens)
        forecast = rollout_forecast(config, report.rollout.pool_tokens, gpus, HARDWARE[args.gpu], lengths)
        print("\n".join(forecast.lines()))
    return 0
