"""CharTokenizer: ids match the tiny presets, round trips, clear errors."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.model_shapes import get_shape
from sparrow_nemo.tasks.tokenizer import CHARSET, CharTokenizer


def test_special_ids_and_vocab_fit_tiny_presets() -> None:
    tok = CharTokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == tok.vocab_size == 3 + len(CHARSET) == 80
    for preset in ("tiny", "tiny-test"):
        shape = get_shape(preset)
        assert tok.vocab_size <= shape.vocab_size
        assert tok.eos_token_id == shape.eos_token_id


def test_round_trip_every_character() -> None:
    tok = CharTokenizer()
    ids = tok.encode(CHARSET)
    assert ids == list(range(3, 3 + len(CHARSET)))
    assert tok.decode(ids) == CHARSET
    assert tok.decode(torch.tensor(ids)) == CHARSET


def test_special_tokens_and_unknown_ids() -> None:
    tok = CharTokenizer()
    ids = [*tok.encode("ab", add_special_tokens=True), tok.eos_token_id, tok.pad_token_id]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>ab<eos><pad>"
    assert tok.decode([tok.encode("x")[0], 127, 200, -1]) == "x\ufffd\ufffd\ufffd"


def test_unknown_character_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"character '@' at position 2"):
        CharTokenizer().encode("ab@c")
