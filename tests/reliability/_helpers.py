"""Helpers for the reliability tests."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def save_char_tokenizer(path: Path, extra_tokens: int = 0) -> Path:
    """A character-level Hugging Face tokenizer (99 ids + ``extra_tokens`` filler ids) saved offline."""
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "<|im_end|>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    vocab |= {f"<extra_{i}>": len(vocab) + i for i in range(extra_tokens)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>").save_pretrained(
        path
    )
    return path
