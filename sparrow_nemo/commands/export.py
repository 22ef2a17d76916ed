"""``sparrow export``: a run's trained policy as a Hugging Face Qwen3 checkpoint (:mod:`sparrow_nemo.grpo.export`).

``sparrow export --run-dir R [--step N] --out DIR`` loads the newest complete step checkpoint of the run folder
(or step N) and writes safetensors (sharded past 5 GB), ``config.json``, ``generation_config.json`` and the
start checkpoint's tokenizer files, which ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads. A
run trained with TP x PP > 1 exports under ``torchrun`` with that many ranks (``torchrun --nproc_per_node=K -m
sparrow_nemo.cli export ...``).
"""

from __future__ import annotations

import argparse

NAME = "export"
HELP = "write a run's trained policy as a Hugging Face Qwen3 checkpoint (safetensors, config, tokenizer)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", required=True, metavar="R", help="the run folder (holds config.yaml)")
    parser.add_argument(
        "--step", type=int, default=None, metavar="N", help="checkpoint step (default: newest)"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="new folder for the HF checkpoint")


def run(args: argparse.Namespace) -> int:
    from sparrow_nemo.grpo import world
    from sparrow_nemo.grpo.export import export_run

    out = export_run(args.run_dir, args.out, args.step)
    if world.rank() == 0:
        print(f"sparrow export: wrote {out}")
    return 0
