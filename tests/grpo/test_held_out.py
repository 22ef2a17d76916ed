"""The held-out prompts (evaluation before/after training, calibration) never are training prompts.

With a prompt file the held-out set is ``data.val_path``; without one there is none (the evaluation is
skipped). Before this, the "held-out" prompts of a file were stream positions 0..n: step 0's training batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sparrow_nemo.config import ConfigError
from sparrow_nemo.grpo.prompt_source import EVAL_OFFSET
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.tasks.chain import ChainTask


def _char_tokenizer(path: Path) -> Path:
    """A character-level HF tokenizer (99 ids) saved offline: the tokenizer of ``model.hf_checkpoint``."""
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "<|im_end|>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>")
    fast.save_pretrained(path)
    return path


def _rows(path: Path, prefix: str, n: int) -> Path:
    path.write_text(
        "".join(json.dumps({"problem": f"{prefix}{i}?", "answer": str(i)}) + "\n" for i in range(n))
    )
    return path


def _texts(source, items) -> set[str]:
    return {source.tokenizer.decode(i.prompt_ids).replace(" ", "") for i in items}  # a char tokenizer


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, Path]:
    return (
        _char_tokenizer(tmp_path / "tok"),
        _rows(tmp_path / "train.jsonl", "train", 24),
        _rows(tmp_path / "val.jsonl", "val", 6),
    )


def test_file_data_evaluates_on_val_path_not_on_training_prompts(files) -> None:
    tok, train, val = files
    overrides = [
        "reward.type=math",
        "control.calibrate=false",
        f"model.hf_checkpoint={tok}",
        f"data.train_path={train}",
    ]
    source = build_prompt_source(load_config("tiny_cpu_short", [*overrides, f"data.val_path={val}"]))
    held_out = _texts(source, source.eval_batch(4))
    training = _texts(source, source.peek(3 * 24))  # three epochs of the training stream
    assert held_out == {f"val{i}?" for i in range(4)}
    assert not held_out & training
    assert len(source.eval_batch(100)) == 6  # all of val_path, never padded with training rows


def test_file_data_without_val_path_has_no_held_out_prompts(files) -> None:
    tok, train, _ = files
    config = load_config(
        "tiny_cpu_short",
        [
            "reward.type=math",
            "control.calibrate=false",
            f"model.hf_checkpoint={tok}",
            f"data.train_path={train}",
        ],
    )
    source = build_prompt_source(config)
    assert source.eval_batch(8) == []


def test_synthetic_held_out_problems_are_disjoint_from_the_stream() -> None:
    config = load_config("tiny_cpu_short_smoke")
    source = build_prompt_source(config)
    task = ChainTask(config.task)
    held_out = [source.tokenizer.decode(i.prompt_ids) for i in source.eval_batch(8)]
    assert held_out == [task.problem(EVAL_OFFSET + i).prompt for i in range(8)]  # the indices held back
    with pytest.raises(ValueError, match="reached problem 5,000,000, where the held-out problems start"):
        source.peek(1, EVAL_OFFSET)
    assert source.peek(1, EVAL_OFFSET - 1)  # the last training problem is served


def test_calibration_on_file_data_needs_val_path() -> None:
    with pytest.raises(
        ConfigError,
        match=r"data\.val_path=null .* expected a held-out prompt file when control\.calibrate=true",
    ):
        load_config(
            "tiny_cpu_short", ["reward.type=math", "data.train_path=d/t.jsonl", "control.calibrate=true"]
        )
