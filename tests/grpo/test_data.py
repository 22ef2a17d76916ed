"""Prompt loading: JSONL / Parquet, field names, chat templates, bad rows, and the real AIME 2024 file."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sparrow_nemo.grpo.data import PromptDataConfig, PromptDataError, load_prompts
from sparrow_nemo.tasks.tokenizer import CharTokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level Hugging Face tokenizer with a Qwen-like chat template (built offline)."""
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = TEMPLATE
    return tok


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = [json.dumps({"question": f"add {i} and {i}", "solution": str(2 * i)}) for i in range(8)]


def test_jsonl_with_custom_fields_and_raw_prompts(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", [*GOOD[:3], "", json.dumps({"question": "q", "solution": 7})])
    ds = load_prompts(path, CharTokenizer(), PromptDataConfig(prompt_key="question", answer_key="solution"))
    assert len(ds) == 4 and ds.bad_rows == []
    assert ds[0].prompt == "add 0 and 0" and ds[0].answer == "0"
    assert ds[0].prompt_ids == CharTokenizer().encode("add 0 and 0", add_special_tokens=True)  # bos first
    assert ds[3].answer == "7" and ds[3].source == f"{path}:5"  # the blank line 4 is skipped, not counted


def test_bad_rows_are_skipped_counted_and_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = [
        *GOOD,  # lines 1-8
        '{"question": "no answer"}',  # 9: missing field
        '{"question": "q", "solution": [1]}',  # 10: wrong type
        '{"question": 5, "solution": "1"}',  # 11: wrong type
        "{not json",  # 12
        "[1, 2]",  # 13: not an object
        json.dumps({"question": "x" * 50, "solution": "1"}),  # 14: too long
        json.dumps({"question": "caf\u00e9", "solution": "1"}),  # 15: the tokenizer rejects the character
    ]
    path = _write_jsonl(tmp_path / "p.jsonl", lines)
    cfg = PromptDataConfig(
        prompt_key="question", answer_key="solution", max_prompt_tokens=40, max_bad_fraction=0.5
    )
    with caplog.at_level(logging.WARNING, logger="sparrow_nemo.grpo.data"):
        ds = load_prompts(path, CharTokenizer(), cfg)
    assert len(ds) == 8 and ds.total_rows == 15
    assert [b.source for b in ds.bad_rows] == [f"{path}:{i}" for i in range(9, 16)]
    reasons = [b.reason for b in ds.bad_rows]
    assert "missing field 'solution'" in reasons[0]
    assert "field 'solution': must be a non-empty string or an integer, got list" in reasons[1]
    assert "'question' must be a non-empty string or chat messages, got int" in reasons[2]
    assert reasons[3].startswith("invalid JSON")
    assert "JSON list" in reasons[4]
    assert "51 tokens > max_prompt_tokens=40" in reasons[5]
    assert "tokenizer rejected" in reasons[6]
    logged = [r.getMessage() for r in caplog.records]
    assert sum("skipping bad prompt row" in m for m in logged) == 5  # report_first
    assert any("skipped 7 of 15 rows" in m for m in logged)
    with pytest.raises(PromptDataError, match=rf"7 of 15 rows are bad.*{path.name}:9: missing field"):
        load_prompts(path, CharTokenizer(), PromptDataConfig(**{**cfg.__dict__, "max_bad_fraction": 0.4}))


def test_parquet_and_gzip(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in GOOD]
    pq.write_table(pa.Table.from_pylist([*rows, {"question": None, "solution": "1"}]), tmp_path / "p.parquet")
    with gzip.open(tmp_path / "p.jsonl.gz", "wt") as fh:
        fh.write("\n".join(GOOD))
    cfg = PromptDataConfig(prompt_key="question", answer_key="solution", max_bad_fraction=0.2)
    from_parquet = load_prompts(tmp_path / "p.parquet", CharTokenizer(), cfg)
    from_gzip = load_prompts(tmp_path / "p.jsonl.gz", CharTokenizer(), cfg)
    assert [e.prompt_ids for e in from_parquet] == [e.prompt_ids for e in from_gzip]
    assert from_parquet.bad_rows[0].source.endswith("p.parquet:9")


def test_chat_template_is_applied(tmp_path: Path, chat_tokenizer: PreTrainedTokenizerFast) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", GOOD[:2])
    cfg = PromptDataConfig(prompt_key="question", answer_key="solution", system_prompt="Be brief.")
    ex = load_prompts(path, chat_tokenizer, cfg)[1]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nadd 1 and 1<|im_end|>\n<|im_start|>assistant\n"
    assert ex.prompt == expected
    assert ex.prompt_ids == chat_tokenizer.encode(expected, add_special_tokens=False)
    assert ex.prompt_ids[0] == chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    raw = load_prompts(
        path, chat_tokenizer, PromptDataConfig(**{**cfg.__dict__, "apply_chat_template": False})
    )
    assert raw[1].prompt == "add 1 and 1"


def test_file_level_errors(tmp_path: Path) -> None:
    tok = CharTokenizer()
    with pytest.raises(PromptDataError, match="no rows"):
        load_prompts(_write_jsonl(tmp_path / "empty.jsonl", ["", "  "]), tok)
    with pytest.raises(PromptDataError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl", tok)
    with pytest.raises(PromptDataError, match="unsupported prompt file type"):
        load_prompts(tmp_path / "p.csv", tok)
    with pytest.raises(ValueError, match="max_bad_fraction"):
        PromptDataConfig(max_bad_fraction=1.5)


def test_real_aime24(shared_data: Path, chat_tokenizer: PreTrainedTokenizerFast) -> None:
    path = shared_data / "aime24.jsonl"
    ds = load_prompts(path, chat_tokenizer)
    assert len(ds) == 30 and ds.bad_rows == []
    assert ds[0].answer == "204" and all(e.answer.isdigit() for e in ds)
    assert ds[0].prompt.startswith("<|im_start|>user\nEvery morning Aya")
    assert ds[0].prompt.endswith("<|im_start|>assistant\n")
    lengths = sorted(len(e.prompt_ids) for e in ds)
    cap = lengths[len(lengths) // 2]
    shorter = load_prompts(
        path, chat_tokenizer, PromptDataConfig(max_prompt_tokens=cap, max_bad_fraction=0.6)
    )
    n_long = sum(n > cap for n in lengths)
    assert len(shorter.bad_rows) == n_long and n_long > 0
    assert all(b.source.startswith(f"{path}:") and "max_prompt_tokens" in b.reason for b in shorter.bad_rows)
    with pytest.raises(PromptDataError, match=f"{n_long} of 30 rows are bad"):
        load_prompts(path, chat_tokenizer, PromptDataConfig(max_prompt_tokens=cap))
