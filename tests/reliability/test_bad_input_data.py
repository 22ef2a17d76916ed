"""Bad prompt data: each case is one clear error naming the file (and line), or a counted bad row.

Also the code recipe's answers: test specs as dicts, assert lists and JSON strings load from a JSONL file
and reach the code reward; a malformed spec is a bad row with its line, not a crash in the middle of a run.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow_nemo.grpo import data
from sparrow_nemo.grpo.data import PromptDataConfig, PromptDataError, load_prompts
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.rewards.code import parse_test_spec
from sparrow_nemo.tasks.tokenizer import CharTokenizer

from ._helpers import save_char_tokenizer

CFG = PromptDataConfig(prompt_key="problem", answer_key="answer")
GOOD = json.dumps({"problem": "1 + 1", "answer": "2"})


def test_empty_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    with pytest.raises(PromptDataError, match=rf"^{path}: the file has no rows$"):
        load_prompts(path, CharTokenizer(), CFG)


def test_invalid_json_and_utf8_lines_are_bad_rows_with_their_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(
        f"{GOOD}\n{{oops\n".encode() + b'{"problem": "caf\xe9", "answer": "1"}\n' + GOOD.encode()
    )
    ds = load_prompts(path, CharTokenizer(), PromptDataConfig(max_bad_fraction=0.5))
    assert len(ds) == 2
    assert [(b.source, b.reason.split(" (")[0]) for b in ds.bad_rows] == [
        (f"{path}:2", "invalid JSON"),
        (f"{path}:3", "invalid UTF-8 at byte 16"),
    ]


def test_all_rows_bad_is_an_error_even_when_bad_rows_are_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n[1]\n")
    lenient = PromptDataConfig(max_bad_fraction=1.0)
    with pytest.raises(
        PromptDataError, match=rf"^{path}: 2 of 2 rows are bad, none is usable; first: {path}:1"
    ):
        load_prompts(path, CharTokenizer(), lenient)


def test_parquet_without_the_prompt_column_names_file_and_columns(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1 + 1", "answer": "2"}]), path)
    with pytest.raises(
        PromptDataError, match=rf"^{path}: no column 'problem' \(columns: question, answer\)$"
    ):
        load_prompts(path, CharTokenizer(), CFG)


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("p.parquet", b"PAR1 not really", "not a readable Parquet file"),
        ("p.jsonl.gz", b"\x1f\x8b\x08\x00garbage", "cannot read the file"),
        ("t.jsonl.gz", gzip.compress(GOOD.encode() * 50)[:-30], "cannot read the file"),  # truncated stream
    ],
)
def test_unreadable_files_name_the_file(tmp_path: Path, name: str, content: bytes, match: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(PromptDataError, match=rf"^{path}: {match}"):
        load_prompts(path, CharTokenizer(), CFG)


# ----- the code recipe's answers ----------------------------------------------------------------------
SQUARE = """```python
import sys


def sq(x):
    return x * x


for word in sys.stdin.read().split():
    print(sq(int(word)))
```"""
CODE_ROWS = [
    {"problem": "stdin", "tests": {"format": "stdio", "inputs": ["3\n"], "outputs": ["9"]}},
    {"problem": "assert list", "tests": ["assert sq(4) == 16", "assert sq(-2) == 4"]},
    {"problem": "json string", "tests": json.dumps({"format": "asserts", "tests": ["assert sq(5) == 25"]})},
    {"problem": "bad format", "tests": {"format": "java", "tests": []}},
    {"problem": "bad mode", "tests": {"format": "asserts", "tests": ["assert 1"], "mode": "best"}},
    {"problem": "bad json", "tests": "{not json"},
    {"problem": "a number", "tests": 7},
]


def test_code_jsonl_with_test_specs_loads_and_rewards(tmp_path: Path) -> None:
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CODE_ROWS))
    ckpt = save_char_tokenizer(tmp_path / "ckpt")
    config = load_config(
        "tiny_cpu",
        [
            "reward.type=code",
            "sparsity.calibrate=false",
            f"data.train_path={data}",
            "data.answer_key=tests",
            "data.max_bad_fraction=0.6",
            f"model.hf_checkpoint={ckpt}",
        ],
    )
    source = build_prompt_source(config)
    assert source.size == 3
    answers = [item.answer for item in source.peek(3)]
    assert sorted(a["format"] for a in answers) == ["asserts", "asserts", "stdio"]
    assert [source.reward_fn(SQUARE, a) for a in answers] == [1.0, 1.0, 1.0]
    assert [source.reward_fn("def sq(x):\n    return x", a) for a in answers] == [0.0, 0.0, 0.0]


def test_code_specs_are_checked_with_one_line_reasons(tmp_path: Path) -> None:
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CODE_ROWS))
    ds = load_prompts(
        data,
        CharTokenizer(),
        PromptDataConfig(answer_key="tests", max_bad_fraction=0.6),
        parse_answer=parse_test_spec,
    )
    assert [b.source for b in ds.bad_rows] == [f"{data}:{i}" for i in (4, 5, 6, 7)]
    assert [b.reason for b in ds.bad_rows] == [
        "field 'tests': unknown code test format 'java'; expected 'humaneval', 'stdio' or 'asserts'",
        "field 'tests': code test spec 'mode' must be one of ('fraction', 'all'), got 'best'",
        "field 'tests': code test spec string is not JSON (Expecting property name enclosed in double quotes "
        "at column 2)",
        "field 'tests': code test spec must be a dict, a list of asserts or a JSON string, got int",
    ]
    with pytest.raises(ValueError, match="unexpected keyword argument 'cpu'"):
        parse_test_spec({"format": "asserts", "tests": ["assert 1"], "limits": {"cpu": 1}})


# ----- tokenizer vs model vocabulary ------------------------------------------------------------------
def test_tokenizer_larger_than_the_model_vocab_names_both_sizes(tmp_path: Path) -> None:
    data = tmp_path / "math.jsonl"
    data.write_text(GOOD + "\n")
    ckpt = save_char_tokenizer(tmp_path / "ckpt", extra_tokens=60)  # 159 ids > the tiny model's 128
    config = load_config(
        "tiny_cpu",
        [
            "reward.type=math",
            "sparsity.calibrate=false",
            f"data.train_path={data}",
            f"model.hf_checkpoint={ckpt}",
        ],
    )
    with pytest.raises(
        ValueError, match=rf"^tokenizer \({ckpt}\) has 159 token ids but the model's vocab_size is 128: "
    ):
        build_prompt_source(config)


def test_deep_huge_and_overlong_rows_are_bad_rows_not_crashes(tmp_path: Path) -> None:
    """100,000-deep JSON, a row nested past MAX_ROW_DEPTH, a 60 MB line (over MAX_ROW_BYTES: never parsed)
    and a 20 MB prompt (refused on its characters before the tokenizer sees it) are bad rows with their line."""
    path = tmp_path / "p.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    nested = json.dumps({"problem": "x", "answer": "2", "extra": []}).replace("[]", "[" * 70 + "]" * 70)
    line_60mb = json.dumps({"problem": "7" * 60_000_000, "answer": "2"})
    prompt_20mb = json.dumps({"problem": "7" * 20_000_000, "answer": "2"})
    with path.open("w") as fh:
        fh.write("\n".join([GOOD, deep, nested, line_60mb, prompt_20mb, GOOD, GOOD]) + "\n")
    tokenizer = _CountingTokenizer()
    ds = load_prompts(path, tokenizer, PromptDataConfig(max_prompt_tokens=64, max_bad_fraction=0.6))
    assert len(ds) == 3
    assert [(b.source.rsplit(":", 1)[1], b.reason) for b in ds.bad_rows] == [
        ("2", f"JSON nested deeper than the parser allows (rows may nest {data.MAX_ROW_DEPTH} levels)"),
        ("3", f"row nested deeper than {data.MAX_ROW_DEPTH} levels"),
        ("4", f"line longer than {data.MAX_ROW_BYTES} bytes"),
        (
            "5",
            f"prompt has 20000000 characters, more than {data.MAX_CHARS_PER_TOKEN} per allowed token "
            "(max_prompt_tokens=64); refused before tokenizing",
        ),
    ]
    assert max(tokenizer.lengths) < 100  # the tokenizer never saw a long prompt


class _CountingTokenizer(CharTokenizer):
    """Records the length of every text it is asked to encode."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.lengths.append(len(text))
        return super().encode(text, add_special_tokens=add_special_tokens)
