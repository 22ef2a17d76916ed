"""CharTokenizer: ids match the tiny presets, round trips, clear errors."""

from __future__ import annotations

import pytest
import torch

from sparrow_nemo.model_shapes import get_shape
from sparrow_nemo.tasks.tokenizer import CHARSET, EXTRA_LETTERS, MAX_LETTERS, CharTokenizer, alphabet


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


def test_more_letters_add_two_ids_each_and_keep_the_first_80() -> None:
    base = CharTokenizer()
    big = CharTokenizer(letters=300)
    assert big.vocab_size == 80 + 2 * (300 - 26)
    assert big.encode(CHARSET) == base.encode(CHARSET)  # the original ids do not move
    letters = alphabet(300)
    assert letters[:26] == "ABCDEFGHIJKLMNOPQRSTUVWXYZ" and len(set(letters)) == 300
    text = letters + letters.lower()
    assert big.decode(big.encode(text)) == text and len(big.encode(text)) == len(text)  # one id per letter
    assert all(len(c.lower()) == 1 and c.lower().upper() == c for c in EXTRA_LETTERS)
    with pytest.raises(ValueError, match=f"letters must be in \\[1, {MAX_LETTERS}\\]"):
        alphabet(MAX_LETTERS + 1)
    with pytest.raises(ValueError, match="is not in the vocabulary"):
        base.encode(letters[100])
