"""``sparrow bench rollout``: dense vs sparse decode tokens/s next to the memory bound, and the tail per bin.

Runs the torch rollout engine on the recipe's model and sparsity geometry (random weights unless
``model.hf_checkpoint`` is set), with ``trainer.cpu_threads`` torch threads on the CPU. First the decode
throughput at each ``--contexts`` cached length: dense, a fixed budget of ``--sparse-fraction`` of the
context, and the recipe's schedule, beside the memory-bound limit of dense decode (bytes per step over the
copy bandwidth measured in the same run). Then random prompts generated with EOS ignored (dense, the
smallest useful fixed budget, the recipe's schedule), scored dense for the acceptance-rate tail per bin.
The attention-kernel benchmark is ``benchmarks/sparse_attention.py``; JSON lines: ``benchmarks/cpu_decode.py``.
"""

from __future__ import annotations

import argparse

from sparrow_nemo.commands._common import add_config_arguments, config_from_args

NAME = "bench"
HELP = "benchmarks: 'bench rollout' (dense vs sparse tokens/s, memory bound, acceptance-rate tail per bin)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    rollout = targets.add_parser(
        "rollout",
        help="dense vs sparse rollout tokens/s, the memory bound and the acceptance-rate tail per bin",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    rollout.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[512, 1024, 2048, 4096],
        help="cached lengths for the throughput table (default 512 1024 2048 4096)",
    )
    rollout.add_argument("--batch", type=int, default=128, help="rows decoded together (default 128)")
    rollout.add_argument("--steps", type=int, default=32, help="decode steps timed per context (default 32)")
    rollout.add_argument(
        "--sparse-fraction",
        type=float,
        default=0.1,
        help="fixed budget as a fraction of the context, rounded to pages (default 0.1)",
    )
    rollout.add_argument("--tail-batch", type=int, default=8, help="sequences of the tail run (default 8)")
    rollout.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens (default 64)")
    rollout.add_argument(
        "--gen-len",
        type=int,
        default=None,
        help="generated tokens per sequence of the tail run (default: rollout.max_new_tokens)",
    )
    rollout.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    add_config_arguments(rollout)


def fraction_schedule(fraction: float, context: int, bin_tokens: int, page_size: int, min_budget: int):
    """One fixed budget of ``fraction`` of ``context`` tokens (whole pages, at least ``min_budget``)."""
    from sparrow_nemo.sparse.schedule import BudgetSchedule

    tokens = max(min_budget, round(fraction * context / page_size) * page_size)
    return BudgetSchedule(bin_tokens, (tokens,), page_size, name=f"{fraction:.0%} fixed")


def run(args: argparse.Namespace) -> int:
    from sparrow_nemo.config import ConfigError
    from sparrow_nemo.grpo.setup import apply_cpu_threads
    from sparrow_nemo.policy.model import resolve_dtype
    from sparrow_nemo.rollout.tools.bench import (
        bench_rollout,
        decode_throughput,
        format_throughput,
        make_engine,
    )
    from sparrow_nemo.sparse.schedule import BudgetSchedule

    config = config_from_args(args)
    if not 0 < args.sparse_fraction <= 1:
        raise ConfigError(f"--sparse-fraction={args.sparse_fraction} - expected a fraction in (0, 1]")
    apply_cpu_threads(config)
    s = config.sparsity
    recipe = s.build_schedule()
    engine = make_engine(
        config.model.shape(),
        config.model.hf_checkpoint,
        args.device,
        resolve_dtype(config.model.dtype),
        config.trainer.seed,
        dense_layers=s.dense_layers,
        page_size=s.page_size,
        sink_pages=s.sink_pages,
        local_pages=s.local_pages,
        page_score=s.page_score,
        attention_backend=config.rollout.attention_impl,
    )
    limit = engine.shape.max_position_embeddings - args.steps - 2  # the timed steps need positions too
    if limit < 1 or min(args.contexts) < 1:
        raise ConfigError(
            f"--contexts {args.contexts} with --steps {args.steps}: expected contexts >= 1 and steps + 2 < "
            f"the model's {engine.shape.max_position_embeddings} positions"
        )
    contexts = [min(c, limit) for c in args.contexts]
    if contexts != list(args.contexts):
        print(f"contexts {args.contexts} -> {contexts}: the model has {limit + args.steps + 2} positions")

    def schedules(context: int):
        fixed = fraction_schedule(args.sparse_fraction, context, s.bin_tokens, s.page_size, s.min_budget)
        return [fixed] if recipe.is_dense else [fixed, recipe]

    print(
        format_throughput(
            decode_throughput(engine, contexts, schedules, args.batch, args.steps, config.trainer.seed)
        )
    )
    print()
    smallest = BudgetSchedule.from_preset(f"fixed:{s.min_budget}", s.bin_tokens, s.page_size)
    bench_rollout(
        engine,
        batch=args.tail_batch,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len or config.rollout.max_new_tokens,
        schedules=[smallest] if recipe.is_dense else [smallest, recipe],
        seed=config.trainer.seed,
        tail_bin_tokens=s.bin_tokens,
    )
    return 0
