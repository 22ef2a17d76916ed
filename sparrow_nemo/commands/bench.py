"""``sparrow bench rollout``: dense vs sparse rollout tokens/s and the acceptance-rate tail per bin.

Runs the torch rollout engine on the recipe's model (random weights unless ``model.hf_checkpoint`` is set)
with random prompts, EOS ignored: once dense, once with a fixed budget of the smallest useful size
(sink + local + one page) and once with the recipe's schedule; the sparse rollouts are scored dense to
measure the acceptance rate. The attention-kernel benchmark is ``benchmarks/sparse_attention.py``.
"""

from __future__ import annotations

import argparse

from sparrow_nemo.commands._common import add_config_arguments, config_from_args

NAME = "bench"
HELP = "benchmarks: 'bench rollout' (dense vs sparse tokens/s and the acceptance-rate tail per bin)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    rollout = targets.add_parser(
        "rollout",
        help="dense vs sparse rollout tokens/s and the acceptance-rate tail per bin",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    rollout.add_argument("--batch", type=int, default=8, help="sequences decoded together (default 8)")
    rollout.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens (default 64)")
    rollout.add_argument(
        "--gen-len",
        type=int,
        default=None,
        help="generated tokens per sequence (default: rollout.max_new_tokens)",
    )
    rollout.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    add_config_arguments(rollout)


def run(args: argparse.Namespace) -> int:
    from sparrow_nemo.rollout.bench import bench_rollout

    config = config_from_args(args)
    sparsity = config.sparsity
    bench_rollout(
        config.model.shape(),
        batch=args.batch,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len or config.rollout.max_new_tokens,
        schedules=[f"fixed:{sparsity.min_budget}", sparsity.build_schedule()],
        device=args.device,
        seed=config.trainer.seed,
        dense_layers=sparsity.dense_layers,
        page_size=sparsity.page_size,
        sink_pages=sparsity.sink_pages,
        local_pages=sparsity.local_pages,
        tail_bin_tokens=sparsity.bin_tokens,
        model_dir=config.model.hf_checkpoint,
        attention_backend=config.rollout.attention_impl,
    )
    return 0
