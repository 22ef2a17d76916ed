"""A character-level tokenizer for the synthetic task, matching the "tiny" model presets.

Ids: 0 = pad, 1 = bos, 2 = eos (the presets' ``eos_token_id``), then one id per character of
:data:`CHARSET` (newline, space, digits, letters, a little punctuation): 80 ids in all, so it fits both
the "tiny" (vocab 128) and "tiny-test" (vocab 96) presets. Model ids >= ``vocab_size`` (a model's vocab
may be larger) decode to U+FFFD, so that any sampled sequence decodes.

``CharTokenizer(letters=n)`` with n > 26 adds the first n - 26 of :data:`EXTRA_LETTERS` (upper-case
letters beyond ASCII that have a one-character lower case: Latin-1, Latin Extended-A and Additional, Greek,
Cyrillic, Armenian) and their lower cases, two ids each: the chain task's single-token names of large tables.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
CHARSET = "\n " + string.digits + string.ascii_lowercase + string.ascii_uppercase + ".,:;=>+-*?!()"
UNKNOWN_CHAR = "\ufffd"
#: code point ranges scanned for :data:`EXTRA_LETTERS`, in order
_EXTRA_RANGES = (
    (0xC0, 0xDE),  # Latin-1 Supplement
    (0x100, 0x17F),  # Latin Extended-A
    (0x391, 0x3A9),  # Greek
    (0x400, 0x42F),  # Cyrillic
    (0x531, 0x556),  # Armenian
    (0x460, 0x52F),  # Cyrillic Supplement / historic
    (0x1E00, 0x1EFF),  # Latin Extended Additional
)


def _extra_letters() -> str:
    """Upper-case letters of :data:`_EXTRA_RANGES` whose lower case is one other character that maps back."""
    out = []
    for lo, hi in _EXTRA_RANGES:
        for cp in range(lo, hi + 1):
            c = chr(cp)
            low = c.lower()
            if c.isupper() and len(low) == 1 and low != c and low.upper() == c:
                out.append(c)
    return "".join(out)


#: upper-case letters beyond ASCII with a one-character lower case, in code point order
EXTRA_LETTERS = _extra_letters()
#: the most letters a tokenizer (and a chain task's alphabet) can have
MAX_LETTERS = 26 + len(EXTRA_LETTERS)


def alphabet(letters: int) -> str:
    """The first ``letters`` upper-case letters: A-Z, then :data:`EXTRA_LETTERS`."""
    if not 1 <= letters <= MAX_LETTERS:
        raise ValueError(f"letters must be in [1, {MAX_LETTERS}], got {letters}")
    return (string.ascii_uppercase + EXTRA_LETTERS)[:letters]


class CharTokenizer:
    """Character tokenizer with the small part of the Hugging Face interface the project uses.

    ``encode(text, add_special_tokens=False) -> list[int]``, ``decode(ids, skip_special_tokens=True) -> str``,
    ``pad_token_id`` / ``bos_token_id`` / ``eos_token_id``, ``vocab_size``, and ``chat_template = None``
    (prompt loaders then use the raw text).
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    chat_template = None

    def __init__(self, letters: int = 26) -> None:
        extra = alphabet(max(letters, 26))[26:]
        self.letters = max(letters, 26)
        chars = CHARSET + extra + extra.lower()
        self._char_to_id = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        self._id_to_char = dict(enumerate(SPECIAL_TOKENS)) | {i: c for c, i in self._char_to_id.items()}

    @property
    def vocab_size(self) -> int:
        """Number of ids (specials + characters)."""
        return len(SPECIAL_TOKENS) + len(self._char_to_id)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of the characters of ``text``; with ``add_special_tokens`` a leading bos.

        Raises ValueError naming the first character outside :data:`CHARSET`.
        """
        ids = [self.bos_token_id] if add_special_tokens else []
        for pos, ch in enumerate(text):
            if ch not in self._char_to_id:
                raise ValueError(
                    f"CharTokenizer.encode: character {ch!r} at position {pos} is not in the vocabulary "
                    f"(allowed: specials {SPECIAL_TOKENS} and {CHARSET!r})"
                )
            ids.append(self._char_to_id[ch])
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (ints or a 1-D tensor); unknown ids become U+FFFD; specials dropped or spelled out."""
        out = []
        for raw in ids:
            i = int(raw)
            if i < len(SPECIAL_TOKENS) and i >= 0:
                if not skip_special_tokens:
                    out.append(SPECIAL_TOKENS[i])
            else:
                out.append(self._id_to_char.get(i, UNKNOWN_CHAR))
        return "".join(out)
