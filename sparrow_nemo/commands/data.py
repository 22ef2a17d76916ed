"""``sparrow data check``: the recipe's prompts exactly as the model sees them, before any run.

Prints the files read and the columns used, then the first ``--rows`` usable rows as the model gets them (the
templated text, its token count, the data source and the parsed answer), then every bad row by file and line
with its reason (the trainer skips them), and whether training would accept the file (``data.max_bad_fraction``).
Exit status 0 when it would, 1 when not. The synthetic task (``reward.type: chain``) prints its first problems.
"""

from __future__ import annotations

import argparse

from sparrow_nemo.commands._common import add_config_arguments, config_from_args

NAME = "data"
HELP = (
    "inspect the recipe's prompts: 'data check' prints the first rows as the model sees them and the bad rows"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="the first rows as the model sees them (templated text, token count), the columns used, bad rows",
        description="Read data.train_path (and data.val_path) as training would and print what the model sees.",
    )
    check.add_argument("--rows", type=int, default=3, metavar="N", help="usable rows to print per file (3)")
    add_config_arguments(check)


def _print_rows(label: str, rows: list[tuple[str, str, int, object, str | None]]) -> None:
    for source, text, tokens, answer, data_source in rows:
        origin = f", data_source={data_source}" if data_source is not None else ""
        print(f"--- {label} {source} ({tokens} tokens{origin}) ---")
        print(text)
        print(f"--- answer: {answer!r}")


def _check_file(config, key: str, tokenizer, rows: int) -> bool:
    from sparrow_nemo.data.readers import dataset_files
    from sparrow_nemo.grpo.data import PromptDataError, read_prompts
    from sparrow_nemo.grpo.prompts import answer_route

    data = config.data
    path = getattr(data, key)
    files = dataset_files(path)
    print(f"data.{key}: {path} ({len(files)} file{'s' if len(files) != 1 else ''})")
    dataset = read_prompts(path, tokenizer, data, route=answer_route(config))
    shown = [
        (e.source, e.prompt, len(e.prompt_ids), e.answer, e.data_source) for e in dataset.examples[:rows]
    ]
    _print_rows("row", shown)
    total, bad = dataset.total_rows, len(dataset.bad_rows)
    print(f"data.{key}: {len(dataset)} usable and {bad} bad of {total} rows")
    for row in dataset.bad_rows:
        print(f"bad row {row.source}: {row.reason}")
    if total == 0 or not dataset.examples or bad / total > data.max_bad_fraction:
        error = PromptDataError(
            f"{path}: training refuses it ({bad} of {total} rows bad, "
            f"data.max_bad_fraction={data.max_bad_fraction})"
        )
        print(f"data.{key}: {error}")
        return False
    return True


def run(args: argparse.Namespace) -> int:
    from sparrow_nemo.grpo.recipe import SYNTHETIC_REWARD

    config = config_from_args(args)
    data = config.data
    if config.reward.type == SYNTHETIC_REWARD:
        from sparrow_nemo.grpo.prompts import build_prompt_source

        source = build_prompt_source(config)
        print(f"reward.type={SYNTHETIC_REWARD}: the synthetic task makes its prompts (no data file)")
        items = source.peek(args.rows)
        _print_rows(
            "problem",
            [
                (str(i), source.tokenizer.decode(it.prompt_ids), len(it.prompt_ids), it.answer, None)
                for i, it in enumerate(items)
            ],
        )
        return 0
    from sparrow_nemo.grpo.prompts import file_tokenizer

    tokenizer = file_tokenizer(config)
    template = (
        "the tokenizer's chat template" if data.apply_chat_template and tokenizer.chat_template else "none"
    )
    print(
        f"columns: prompt '{data.prompt_key}', answer '{data.answer_key}', data source '{data.data_source_key}'"
        f"; chat template: {template} {dict(data.chat_template_kwargs) or ''}; "
        f"prompt template: {data.prompt_template or 'none'}"
    )
    ok = _check_file(config, "train_path", tokenizer, args.rows)
    if data.val_path is not None:
        ok = _check_file(config, "val_path", tokenizer, args.rows) and ok
    return 0 if ok else 1
