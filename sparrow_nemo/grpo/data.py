"""Prompt datasets for GRPO: rows of data files (:mod:`sparrow_nemo.data.readers`), validated and tokenized.

Each row holds a prompt and an answer under configurable keys; a dotted key reads a nested field
(``reward_model.ground_truth``, verl's and DAPO-Math-17k's layout) unless the row has that literal key. The
prompt is a string or a list of chat messages (``{"role", "content"}``: verl, TRL's conversational format).
``data.prompt_template`` (a string holding ``{problem}``, or a file holding one) wraps a string prompt, or the
last user message. The prompt goes through the tokenizer's chat template when it has one
(``tokenizer.apply_chat_template`` with ``data.chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``, a
string prompt as a single user turn, ``data.system_prompt`` first when the messages have no system turn, and
the generation prompt); otherwise the raw text is used and the tokenizer adds its own special tokens (bos).
``data.data_source_key`` (verl's ``data_source``) is carried with each example: the reward can be routed by it
(``reward.by_data_source``).

What an answer may be is the reward's business: ``parse_answer`` checks and converts it (default
:func:`text_answer`: a string, or an integer turned into one; the code reward passes its test-spec parser).

A bad row (what the reader refuses: invalid JSON or UTF-8, a line over the size bound, nesting too deep; not an
object, a missing field, an answer ``parse_answer`` refuses, a prompt with a lone surrogate, one the tokenizer
rejects or one longer than ``max_prompt_tokens``) is skipped and counted; the first ``report_first`` are
logged with file and line. Loading fails with a one-line :class:`PromptDataError` naming the file when more
than ``max_bad_fraction`` of the rows are bad, when no row is usable, when there are no rows, or when a file
is unreadable or over a bound (:mod:`sparrow_nemo.data.readers`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sparrow_nemo.config.schema import AT_LEAST_ONE, NON_NEGATIVE, UNIT, Section, knob
from sparrow_nemo.data.readers import (
    MAX_ROW_BYTES,
    MAX_ROW_DEPTH,
    SUFFIXES,
    DataFileError,
    RowProblem,
    dataset_files,
    read_rows,
)

__all__ = [
    "MAX_ROW_BYTES",
    "MAX_ROW_DEPTH",
    "BadRow",
    "PromptDataConfig",
    "PromptDataError",
    "PromptDataset",
    "PromptExample",
    "load_prompts",
    "read_prompts",
    "text_answer",
]

logger = logging.getLogger(__name__)

#: the placeholder of ``data.prompt_template``
PROBLEM = "{problem}"
#: prompts with more characters than this many per allowed token are refused before tokenizing (tokenizing
#: a huge text costs memory in proportion to it; no real prompt averages this many characters per token)
MAX_CHARS_PER_TOKEN = 32


class PromptDataError(DataFileError):
    """A prompt file that cannot be used (missing, empty, unreadable, unknown format, or too many bad rows)."""


class PromptTokenizer(Protocol):
    """What the loader needs from a tokenizer (Hugging Face tokenizers and CharTokenizer qualify)."""

    chat_template: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class PromptDataConfig(Section):
    """The recipe's ``data`` section: the prompt files, where the fields are and how strict to be.

    File existence is checked when the data is read; the suffix (the loader's :data:`SUFFIXES`) when the
    config is loaded. Default ``max_bad_fraction`` 0.01: what every recipe ran with.
    """

    train_path: str | None = knob(
        None,
        "prompts: a JSONL (.jsonl, .jsonl.gz), Parquet or Arrow file, a folder of such shards (a local HF "
        "dataset), or a datasets save_to_disk folder; null = the synthetic task",
    )
    val_path: str | None = knob(
        None,
        "held-out prompts (same format) for the evaluation before/after training and the calibration pass; "
        "null = no held-out evaluation for file data (the synthetic task has its own held-out problems)",
    )
    prompt_key: str = knob(
        "problem", "field holding the prompt: text or a list of chat messages; a.b = field b of field a"
    )
    answer_key: str = knob(
        "answer", "field holding the reference answer; dotted = nested (verl: reward_model.ground_truth)"
    )
    data_source_key: str = knob(
        "data_source", "field naming each row's source (verl), for reward.by_data_source; absent = none"
    )
    prompt_template: str | None = knob(
        None,
        "wraps each prompt: a string holding {problem}, or the path of a file holding one (a message-list "
        "prompt: its last user message); null = the prompt as it is",
    )
    chat_template_kwargs: dict[str, Any] = knob(
        doc="keyword arguments of tokenizer.apply_chat_template (Qwen3: enable_thinking: false skips thinking)",
        factory=dict,
    )
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
            suffix_known = path is None or not Path(path).suffix or path.lower().endswith(SUFFIXES)
            if not suffix_known and not Path(path).is_dir():
                raise self.invalid(key, f"a file ending in {', '.join(SUFFIXES)}, or a folder of them")
        if self.prompt_template is not None:
            try:
                self.template_text()
            except ValueError as exc:
                raise self.invalid("prompt_template", str(exc)) from None

    def template_text(self) -> str | None:
        """The prompt template's text (``prompt_template`` itself, or its file's); a ValueError when it has no
        ``{problem}``."""
        value = self.prompt_template
        if value is None:
            return None
        if PROBLEM in value:
            return value
        path = Path(value)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"a string holding {PROBLEM} or a readable template file ({exc})") from None
        if PROBLEM not in text:
            raise ValueError(f"a template holding {PROBLEM}; the file {path} has none")
        return text


@dataclass(frozen=True)
class PromptExample:
    """One usable row: ``prompt`` is the text fed to the model (after the chat template), ``prompt_ids`` its
    token ids (list of int), ``answer`` the reward's ground truth (as ``parse_answer`` returned it: a string
    for math, a test-spec dict for code), ``source`` = "file:line", ``data_source`` the row's source name
    (``data.data_source_key``; None when the row has none)."""

    prompt: str
    prompt_ids: list[int]
    answer: Any
    source: str
    data_source: str | None = None


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


#: parse_answer for each data source (None: rows without one)
AnswerRoute = Callable[[str | None], Callable[[Any], Any]]


def _field(row: Any, key: str) -> Any:
    """``row[key]``; a dotted key walks nested objects unless the row has the literal key."""
    if isinstance(row, RowProblem):
        raise _BadRowError(str(row))
    if not isinstance(row, dict):
        raise _BadRowError(f"row is a JSON {type(row).__name__}, expected an object")
    if key in row:
        return row[key]
    value: Any = row
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not isinstance(value, dict) or part not in value:
            where = ".".join(parts[:depth]) or "the row"
            fields = ", ".join(map(str, value)) if isinstance(value, dict) else type(value).__name__
            raise _BadRowError(f"missing field '{key}' ({where} has: {fields or 'none'})")
        value = value[part]
    return value


def _messages(prompt: Any, key: str) -> list[dict[str, str]]:
    """A prompt as chat messages: a string is one user turn; a list must hold {role, content} strings."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _BadRowError(
                f"field '{key}' must be a non-empty string or chat messages, got an empty string"
            )
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise _BadRowError(
            f"field '{key}' must be a non-empty string or chat messages, got {type(prompt).__name__}"
        )
    messages = []
    for i, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise _BadRowError(
                f"field '{key}' message {i}: expected {{role: str, content: str}}, got {m!r:.80}"
            )
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise _BadRowError(f"field '{key}': no non-empty user message")
    return messages


def _templated(messages: list[dict[str, str]], template: str | None) -> list[dict[str, str]]:
    """The last user message wrapped in ``template`` (``{problem}`` replaced; other braces kept)."""
    if template is None:
        return messages
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    wrapped = template.replace(PROBLEM, messages[last]["content"])
    return [*messages[:last], {**messages[last], "content": wrapped}, *messages[last + 1 :]]


def _prompt_text(
    messages: list[dict[str, str]], tokenizer: PromptTokenizer, config: PromptDataConfig
) -> tuple[str, bool]:
    """(model input text, whether the tokenizer should add its special tokens)."""
    if config.apply_chat_template and getattr(tokenizer, "chat_template", None):
        if config.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": config.system_prompt}, *messages]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **config.chat_template_kwargs
        )
        return text, False
    return "\n\n".join(m["content"] for m in messages), True


def _check_text(text: str, what: str) -> None:
    """A bad row when ``text`` cannot be UTF-8 (a lone surrogate from a JSON ``\\ud800`` escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _BadRowError(
            f"{what} holds a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start} (not UTF-8)"
        ) from None


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
    route: AnswerRoute,
    template: str | None,
) -> PromptExample:
    messages = _messages(_field(row, config.prompt_key), config.prompt_key)
    chars = sum(len(m["content"]) for m in messages)
    if chars > MAX_CHARS_PER_TOKEN * config.max_prompt_tokens:
        raise _BadRowError(
            f"prompt has {chars} characters, more than {MAX_CHARS_PER_TOKEN} per allowed token "
            f"(max_prompt_tokens={config.max_prompt_tokens}); refused before tokenizing"
        )
    data_source = row.get(config.data_source_key) if config.data_source_key in row else None
    if data_source is not None and not isinstance(data_source, str):
        raise _BadRowError(
            f"field '{config.data_source_key}' must be a string, got {type(data_source).__name__}"
        )
    raw_answer = _field(row, config.answer_key)
    try:
        answer = route(data_source)(raw_answer)
    except ValueError as exc:
        raise _BadRowError(f"field '{config.answer_key}': {exc}") from None
    text, add_special = _prompt_text(_templated(messages, template), tokenizer, config)
    _check_text(text, "the prompt")
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special))
    except (ValueError, TypeError) as exc:
        raise _BadRowError(f"tokenizer rejected the prompt: {exc}") from exc
    if len(ids) > config.max_prompt_tokens:
        raise _BadRowError(f"prompt has {len(ids)} tokens > max_prompt_tokens={config.max_prompt_tokens}")
    return PromptExample(prompt=text, prompt_ids=ids, answer=answer, source=source, data_source=data_source)


def read_prompts(
    path: str | Path,
    tokenizer: PromptTokenizer,
    config: PromptDataConfig | None = None,
    parse_answer: Callable[[Any], Any] = text_answer,
    route: AnswerRoute | None = None,
) -> PromptDataset:
    """Every row of ``path`` (a file or folder, :func:`~sparrow_nemo.data.readers.dataset_files`) as an
    example or a bad row, without the ``max_bad_fraction`` check (``sparrow data check`` lists them all).

    ``route(data_source)`` picks the answer parser of a row's source (default: ``parse_answer`` for all).
    """
    config = config or PromptDataConfig()
    route = route or (lambda _source: parse_answer)
    template = config.template_text()
    top = tuple(dict.fromkeys(k.split(".")[0] for k in (config.prompt_key, config.answer_key)))
    dataset = PromptDataset(examples=[])
    try:
        for file in dataset_files(path):
            for line, row in read_rows(file, top, optional=(config.data_source_key,)):
                source = f"{file}:{line}"
                try:
                    dataset.examples.append(_example(row, source, tokenizer, config, route, template))
                except _BadRowError as exc:
                    dataset.bad_rows.append(BadRow(source, str(exc)))
                    if len(dataset.bad_rows) <= config.report_first:
                        logger.warning("skipping bad prompt row %s: %s", source, exc)
    except PromptDataError:
        raise
    except DataFileError as exc:
        raise PromptDataError(str(exc)) from None
    return dataset


def load_prompts(
    path: str | Path,
    tokenizer: PromptTokenizer,
    config: PromptDataConfig | None = None,
    parse_answer: Callable[[Any], Any] = text_answer,
    route: AnswerRoute | None = None,
) -> PromptDataset:
    """:func:`read_prompts`, then the checks: rows exist, one is usable, at most ``max_bad_fraction`` are bad.

    ``parse_answer`` checks and converts each row's answer (a ValueError makes the row bad).
    """
    config = config or PromptDataConfig()
    dataset = read_prompts(path, tokenizer, config, parse_answer, route)
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
