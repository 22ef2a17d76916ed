"""``sparrow eval``: n samples per prompt with the recipe's engine and schedule; mean@n and unbiased pass@k.

Prompts come from ``--data`` (default ``data.val_path``), read and tokenized exactly as training prompts
are (``data.prompt_key`` / ``answer_key``, the tokenizer of ``model.hf_checkpoint``), in file order; with
neither and ``reward.type: chain`` the task's held-out problems are used. Each prompt gets ``--n``
samples from the engine of ``rollout.backend`` under the schedule of the ``sparsity`` section (override
``sparsity.schedule=dense`` for a dense baseline), rewarded by ``reward.type``. Writes one JSON line per
prompt (rewards, correct count, pass@k, lengths, responses) and a summary JSON next to it, and prints
the summary. Without ``model.hf_checkpoint`` the torch rollout engine runs random weights (smoke tests only).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from sparrow_nemo.commands._common import add_config_arguments

NAME = "eval"
HELP = "evaluate a policy (dense or sparse rollout): n samples per prompt, mean@n and unbiased pass@k"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data",
        default=None,
        help="prompt file (.jsonl, .jsonl.gz, .parquet; default data.val_path)",
    )
    parser.add_argument("--n", type=int, default=16, help="samples per prompt (default 16)")
    parser.add_argument(
        "--k", type=int, nargs="+", default=None, help="pass@k values (default: 1, 2, 4, ... and n)"
    )
    parser.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N prompts")
    parser.add_argument(
        "--out",
        default=None,
        help="per-prompt results JSONL (default <run dir>/eval/<data name>.jsonl); the summary is written "
        "next to it as <name>_summary.json",
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from sparrow_nemo.config import ConfigError
    from sparrow_nemo.evaluation import default_ks, evaluate_samples, summarize
    from sparrow_nemo.grpo import setup
    from sparrow_nemo.grpo.prompts import build_prompt_source
    from sparrow_nemo.grpo.recipe import SYNTHETIC_REWARD
    from sparrow_nemo.run_io.rundir import make_run_dir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.n < 1 or (args.max_prompts is not None and args.max_prompts < 1):
        raise ConfigError(
            f"sparrow eval: --n and --max-prompts must be >= 1, got {args.n}, {args.max_prompts}"
        )
    ks = args.k or default_ks(args.n)
    bad_k = [k for k in ks if not 1 <= k <= args.n]
    if bad_k:
        raise ConfigError(f"sparrow eval: --k values must be in [1, --n={args.n}], got {bad_k}")
    config = _config(args, args.data)
    data = args.data or config.data.val_path
    if data is not None and config.reward.type == SYNTHETIC_REWARD:
        raise ConfigError(
            f"sparrow eval: --data {data} needs a file reward (reward.type=math, code, ...); the recipe has "
            f"the synthetic task (reward.type={SYNTHETIC_REWARD})"
        )
    if data is not None and args.data is None:
        config = _config(args, data)
    source = build_prompt_source(config)
    if source.size is None:  # the synthetic task: endless held-out problems
        count = args.max_prompts or config.evaluation.num_prompts
    else:
        count = min(args.max_prompts or source.size, source.size)
    items = source.eval_batch(count) if data is None else source.peek(count)  # the file, in order

    engine = _build_engine(config, source.tokenizer)
    schedule = config.sparsity.build_schedule()
    results, tokens_per_s = evaluate_samples(
        engine,
        [i.prompt_ids for i in items],
        [i.answer for i in items],
        source.reward,
        setup.sampling_params(config),
        schedule,
        args.n,
        ks,
        decode=source.tokenizer.decode,
    )
    summary = summarize(results, args.n, tokens_per_s, schedule.name)

    name = Path(data).name.split(".")[0] if data else "synthetic"
    out = Path(args.out) if args.out else make_run_dir(config) / "eval" / f"{name}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in results))
    summary_path = out.with_name(f"{out.name.split('.')[0]}_summary.json")
    summary_path.write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    for key, value in summary.to_dict().items():
        print(f"{key:>22}  {value:.4f}" if isinstance(value, float) else f"{key:>22}  {value}")
    print(f"{'results':>22}  {out}")
    return 0


def _config(args: argparse.Namespace, data: str | None):
    """The recipe plus overrides; with ``data``, that file is the prompt set, read in file order
    (it takes the place of ``data.train_path``, whose loader this command reuses)."""
    from sparrow_nemo.grpo.recipe import load_config

    extra = [f"data.train_path={data}", "data.shuffle=false"] if data is not None else []
    return load_config(args.config, [*args.overrides, *extra])


def _build_engine(config, tokenizer):
    """The rollout engine of ``rollout.backend`` over ``model.hf_checkpoint`` (random weights if none)."""
    from sparrow_nemo.config import ConfigError
    from sparrow_nemo.grpo import setup
    from sparrow_nemo.rollout.torch.qwen3 import Qwen3Decoder

    setup.apply_cpu_threads(config)
    checkpoint = config.model.hf_checkpoint
    if config.rollout.backend == "trtllm":
        if checkpoint is None:
            raise ConfigError("sparrow eval: rollout.backend=trtllm needs model.hf_checkpoint")
        return setup.trtllm_engine(config, checkpoint)
    if checkpoint is None:
        log.warning("model.hf_checkpoint is null: evaluating random weights")
        weights = Qwen3Decoder.random(config.model.shape(), seed=config.trainer.seed).params
    else:
        weights = Qwen3Decoder.from_hf_dir(checkpoint).params
    return setup.build_engine(config, weights, tokenizer)
