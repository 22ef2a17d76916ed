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
            "control.calibrate=false",
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
            "control.calibrate=false",
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


# ----- issue 40: hostile files end in one line naming the file / row, readers are bounded -----------------
def test_a_5000_digit_integer_answer_is_a_bad_row_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(GOOD + "\n" + '{"problem": "x", "answer": ' + "7" * 5_000 + "}\n" + GOOD + "\n")
    ds = load_prompts(path, CharTokenizer(), PromptDataConfig(max_bad_fraction=0.5))
    assert len(ds) == 2
    assert [b.source for b in ds.bad_rows] == [f"{path}:2"]
    assert ds.bad_rows[0].reason.startswith("invalid JSON value (Exceeds the limit (4300 digits)")


def test_a_gzip_of_blank_lines_stops_at_the_line_bound(tmp_path: Path, monkeypatch) -> None:
    """2 MB of gzip holding ~2 GB of newlines: refused at readers.MAX_LINES (lowered here: the real bound,
    20 million lines, takes seconds, not the hours that 2 billion blank lines took)."""
    from sparrow_nemo.data import readers

    path = tmp_path / "blank.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=9) as fh:
        block = b"\n" * (1 << 24)
        for _ in range(128):
            fh.write(block)
    assert path.stat().st_size < 3 << 20
    monkeypatch.setattr(readers, "MAX_LINES", 100_000)
    with pytest.raises(PromptDataError, match=rf"^{path}: more than 100,000 lines \(blank ones included\)$"):
        load_prompts(path, CharTokenizer(), CFG)


@pytest.mark.parametrize("target", ["/proc/self/pagemap", "/dev/zero", "/proc/self/fd/0"])
def test_a_symlink_to_a_pseudo_file_is_refused(tmp_path: Path, target: str) -> None:
    link = tmp_path / "p.jsonl"
    link.symlink_to(target)
    with pytest.raises(PromptDataError, match=rf"^{link}: (resolves to .*a kernel pseudo-file|cannot open)"):
        load_prompts(link, CharTokenizer(), CFG)
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").symlink_to(target)
    with pytest.raises(PromptDataError, match=rf"^{folder / 'a.jsonl'}: (resolves to|cannot open)"):
        load_prompts(folder, CharTokenizer(), CFG)


def test_a_symlink_loop_and_a_fifo_are_refused(tmp_path: Path) -> None:
    import os

    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    with pytest.raises(PromptDataError, match=rf"^{loop}: cannot open the data file"):
        load_prompts(loop, CharTokenizer(), CFG)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(PromptDataError, match=rf"^{fifo}: not a regular file"):
        load_prompts(fifo, CharTokenizer(), CFG)


def test_a_dictionary_parquet_that_decodes_to_20_gb_is_refused_before_any_row(tmp_path: Path) -> None:
    """A ~2 MB Parquet whose dictionary column repeats one 10 KB string 2 million times (~20 GB decoded;
    to_pylist of the table asked for all of it at once)."""
    n = 2_000_000
    prompt = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array(["x" * 10_000]))
    answer = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array(["1"]))
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"problem": prompt, "answer": answer}), path)
    assert path.stat().st_size < 3 << 20
    tokenizer = _CountingTokenizer()
    with pytest.raises(PromptDataError, match=rf"^{path}: rows 1-[\d,]+ decode to [\d,]+ bytes \(at most"):
        load_prompts(path, tokenizer, CFG)
    assert tokenizer.lengths == []  # refused in the sizing pass: no row reached the tokenizer


def test_parquet_reads_only_the_columns_used_in_row_batches(tmp_path: Path) -> None:
    rows = [{"problem": f"{i}+{i}", "answer": str(2 * i), "huge": "z" * 100_000} for i in range(600)]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1_000)
    ds = load_prompts(path, CharTokenizer(), CFG)
    assert len(ds) == 600 and ds[599].source == f"{path}:600" and ds[599].answer == "1198"


def test_a_lone_surrogate_is_a_bad_row_not_a_tokenizer_crash(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(GOOD + '\n{"problem": "a \\ud800 b", "answer": "1"}\n' + GOOD + "\n")
    ckpt = save_char_tokenizer(tmp_path / "tok")
    from transformers import AutoTokenizer

    ds = load_prompts(path, AutoTokenizer.from_pretrained(ckpt), PromptDataConfig(max_bad_fraction=0.5))
    assert len(ds) == 2
    assert [(b.source, b.reason) for b in ds.bad_rows] == [
        (f"{path}:2", "the prompt holds a lone surrogate U+D800 at character 2 (not UTF-8)")
    ]
