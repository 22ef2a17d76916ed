"""Prompt datasets for GRPO: rows from JSONL (optionally gzipped) or Parquet files, validated and tokenized.

Each row must hold a prompt (non-empty string) and an answer under configurable field names. What an answer
may be is the reward's business: ``parse_answer`` checks and converts it (default :func:`text_answer`: a
string, or an integer turned into one; the code reward passes its test-spec parser, which takes dicts,
lists and JSON strings). The prompt goes through the tokenizer's chat template when it has one
(``tokenizer.apply_chat_template``, as a single user turn, with the generation prompt); otherwise the raw
text is used and the tokenizer adds its own special tokens (e.g. bos).

A bad row (invalid JSON or UTF-8, a line over :data:`MAX_ROW_BYTES`, nesting deeper than :data:`MAX_ROW_DEPTH`,
not an object, missing field, an answer ``parse_answer`` refuses, a prompt the tokenizer rejects or one
longer than ``max_prompt_tokens``) is skipped and counted; the first
``report_first`` are logged with file and line. Loading fails with a one-line :class:`PromptDataError`
naming the file when more than ``max_bad_fraction`` of the rows are bad, when no row is usable, when the
file has no rows, is unreadable (corrupt gzip / Parquet), or is a Parquet file without the prompt or answer
column.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, UNIT, Section, knob

logger = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
#: a longer JSON line is a bad row, skipped without being parsed
MAX_ROW_BYTES = 32 << 20
#: rows nested deeper (lists / objects in each other) are bad rows
MAX_ROW_DEPTH = 64
#: prompts with more characters than this many per allowed token are refused before tokenizing (tokenizing
#: a huge text costs memory in proportion to it; no real prompt averages this many characters per token)
MAX_CHARS_PER_TOKEN = 32


class PromptDataError(ValueError):
    """A prompt file that cannot be used (missing, empty, unreadable, unknown format, or too many bad rows)."""


class PromptTokenizer(Protocol):
    """What the loader needs from a tokenizer (Hugging Face tokenizers and CharTokenizer qualify)."""

    chat_template: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class PromptDataConfig(Section):
    """The recipe's ``data`` section: the prompt files, where the fields are and how strict to be.

    File existence is checked when the data is read; the suffix (the loader's :data:`SUFFIXES`) when the
    config is loaded. Default ``max_bad_fraction`` 0.01: what every recipe ran with.
    """

    train_path: str | None = knob(
        None, "JSONL (.jsonl, .jsonl.gz) or Parquet prompts; null = the synthetic task"
    )
    val_path: str | None = knob(
        None,
        "held-out prompts (same format) for the evaluation before/after training and the calibration pass; "
        "null = no held-out evaluation for file data (the synthetic task has its own held-out problems)",
    )
    prompt_key: str = knob("problem", "field holding the prompt text")
    answer_key: str = knob("answer", "field holding the reference answer")
    max_prompt_tokens: int = knob(
        2048, "longer prompts (after the chat template) are skipped as bad rows", check=AT_LEAST_ONE
    )
    max_bad_fraction: float = knob(
        0.01, "the run fails when more than this fraction of rows is bad", check=UNIT
    )
    report_first: int = knob(5, "bad rows logged one by one (the rest are counted)", check=NON_NEGATIVE)
    apply_chat_template: bool = knob(
        True, "wrap each prompt in the tokenizer's chat template when it has one"
    )
    system_prompt: str | None = knob(
        None, "a system turn before the user turn (chat template only); null = none"
    )
    shuffle: bool = knob(True, "shuffle prompts each epoch (seeded by trainer.seed)")

    def check(self) -> None:
        for key in ("train_path", "val_path"):
            path = getattr(self, key)
            if path is not None and not path.lower().endswith(SUFFIXES):
                raise self.invalid(key, f"a file ending in {', '.join(SUFFIXES)}")


@dataclass(frozen=True)
class PromptExample:
    """One usable row: ``prompt`` is the text fed to the model (after the chat template), ``prompt_ids`` its
    token ids (list of int), ``answer`` the reward's ground truth (as ``parse_answer`` returned it: a string
    for math, a test-spec dict for code), ``source`` = "file:line"."""

    prompt: str
    prompt_ids: list[int]
    answer: Any
    source: str


@dataclass(frozen=True)
class BadRow:
    """A skipped row: where it is ("file:line") and why."""

    source: str
    reason: str


@dataclass
class PromptDataset:
    """The usable rows of a file plus an account of the skipped ones."""

    examples: list[PromptExample]
    bad_rows: list[BadRow] = field(default_factory=list)

    @property
    def total_rows(self) -> int:
        return len(self.examples) + len(self.bad_rows)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> PromptExample:
        return self.examples[index]


class _BadRowError(ValueError):
    """Raised inside the loader for one row; becomes a BadRow."""


def _parquet_rows(path: Path, columns: tuple[str, ...]) -> list[dict]:
    """The rows of a Parquet file that has ``columns``; PromptDataError when unreadable or a column is missing."""
    import pyarrow as pa  # imported here: only Parquet inputs need it
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise PromptDataError(f"{path}: not a readable Parquet file ({exc})") from None
    for column in columns:
        if column not in table.column_names:
            raise PromptDataError(
                f"{path}: no column '{column}' (columns: {', '.join(table.column_names) or 'none'})"
            )
    return table.to_pylist()


def _read_rows(path: Path, columns: tuple[str, ...]) -> Iterator[tuple[int, Any]]:
    """(1-based line or row number, parsed row or a _BadRowError) for each non-blank row of ``path``.

    ``columns`` must exist in a Parquet file (JSON lines are checked row by row).
    """
    name = path.name.lower()
    if name.endswith(".parquet"):
        yield from enumerate(_parquet_rows(path, columns), start=1)
        return
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        for i, raw in enumerate(_lines(fh), start=1):
            if raw is None:
                yield i, _BadRowError(f"line longer than {MAX_ROW_BYTES} bytes")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield i, _BadRowError(f"invalid UTF-8 at byte {exc.start}")
                continue
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as exc:
                yield i, _BadRowError(f"invalid JSON ({exc.msg} at column {exc.colno})")
            except RecursionError:
                yield (
                    i,
                    _BadRowError(
                        f"JSON nested deeper than the parser allows (rows may nest {MAX_ROW_DEPTH} levels)"
                    ),
                )


def _lines(fh: Any) -> Iterator[bytes | None]:
    """The lines of a binary file, each read with a cap: a longer one is skipped to its end and is None."""
    while raw := fh.readline(MAX_ROW_BYTES + 1):
        if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
            while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield raw


def _depth(value: Any) -> int:
    """Nesting depth of lists/dicts in ``value`` (a scalar is 0), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_ROW_DEPTH:
                return deepest
            todo += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def _field(row: Any, key: str) -> Any:
    if isinstance(row, _BadRowError):
        raise row
    if not isinstance(row, dict):
        raise _BadRowError(f"row is a JSON {type(row).__name__}, expected an object")
    if key not in row:
        raise _BadRowError(f"missing field '{key}' (fields: {', '.join(map(str, row)) or 'none'})")
    return row[key]


def _prompt_text(prompt: str, tokenizer: PromptTokenizer, config: PromptDataConfig) -> tuple[str, bool]:
    """(model input text, whether the tokenizer should add its special tokens)."""
    if config.apply_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        if config.system_prompt:
            messages.insert(0, {"role": "system", "content": config.system_prompt})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
    return prompt, True


def text_answer(value: Any) -> str:
    """The default answer rule: a non-empty string, or an integer (not a bool) turned into one."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a non-empty string or an integer, got {type(value).__name__}")
    return value


def _example(
    row: Any,
    source: str,
    tokenizer: PromptTokenizer,
    config: PromptDataConfig,
    parse_answer: Callable[[Any], Any],
) -> PromptExample:
    if not isinstance(row, _BadRowError) and _depth(row) > MAX_ROW_DEPTH:
        raise _BadRowError(f"row nested deeper than {MAX_ROW_DEPTH} levels")
    prompt = _field(row, config.prompt_key)
    if not isinstance(prompt, str) or not prompt.strip():
        raise _BadRowError(
            f"field '{config.prompt_key}' must be a non-empty string, got {type(prompt).__name__}"
        )
    if len(prompt) > MAX_CHARS_PER_TOKEN * config.max_prompt_tokens:
        raise _BadRowError(
            f"prompt has {len(prompt)} characters, more than {MAX_CHARS_PER_TOKEN} per allowed token "
            f"(max_prompt_tokens={config.max_prompt_tokens}); refused before tokenizing"
        )
    raw_answer = _field(row, config.answer_key)
    try:
        answer = parse_answer(raw_answer)
    except ValueError as exc:
        raise _BadRowError(f"field '{config.answer_key}': {exc}") from None
    text, add_special = _prompt_text(prompt, tokenizer, config)
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special))
    except ValueError as exc:
        raise _BadRowError(f"tokenizer rejected the prompt: {exc}") from exc
    if len(ids) > config.max_prompt_tokens:
        raise _BadRowError(f"prompt has {len(ids)} tokens > max_prompt_tokens={config.max_prompt_tokens}")
    return PromptExample(prompt=text, prompt_ids=ids, answer=answer, source=source)


def load_prompts(
    path: str | Path,
    tokenizer: PromptTokenizer,
    config: PromptDataConfig | None = None,
    parse_answer: Callable[[Any], Any] = text_answer,
) -> PromptDataset:
    """Load, validate and tokenize the prompts of ``path`` (.jsonl, .jsonl.gz or .parquet).

    ``parse_answer`` checks and converts each row's answer (a ValueError makes the row bad).
    """
    config = config or PromptDataConfig()
    path = Path(path)
    if not path.name.lower().endswith(SUFFIXES):
        raise PromptDataError(f"{path}: unsupported prompt file type; expected one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise PromptDataError(f"{path}: prompt file not found")
    dataset = PromptDataset(examples=[])
    try:
        for line, row in _read_rows(path, (config.prompt_key, config.answer_key)):
            source = f"{path}:{line}"
            try:
                dataset.examples.append(_example(row, source, tokenizer, config, parse_answer))
            except _BadRowError as exc:
                dataset.bad_rows.append(BadRow(source, str(exc)))
                if len(dataset.bad_rows) <= config.report_first:
                    logger.warning("skipping bad prompt row %s: %s", source, exc)
    except (OSError, EOFError) as exc:  # a corrupt or truncated gzip stream
        raise PromptDataError(f"{path}: cannot read the file ({exc})") from None
    if dataset.total_rows == 0:
        raise PromptDataError(f"{path}: the file has no rows")
    n_bad = len(dataset.bad_rows)
    if n_bad:
        logger.warning("%s: skipped %d of %d rows", path, n_bad, dataset.total_rows)
    if not dataset.examples or n_bad / dataset.total_rows > config.max_bad_fraction:
        first = "; ".join(f"{b.source}: {b.reason}" for b in dataset.bad_rows[: config.report_first])
        limit = (
            "none is usable"
            if not dataset.examples
            else f"more than max_bad_fraction={config.max_bad_fraction}"
        )
        raise PromptDataError(
            f"{path}: {n_bad} of {dataset.total_rows} rows are bad, {limit}; first: {first}"
        )
    return dataset
