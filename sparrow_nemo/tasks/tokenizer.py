"""A character-level tokenizer for the synthetic task, matching the "tiny" model presets.

Ids: 0 = pad, 1 = bos, 2 = eos (the presets' ``eos_token_id``), then one id per character of
:data:`CHARSET` (newline, space, digits, letters, a little punctuation): 80 ids in all, so it fits both
the "tiny" (vocab 128) and "tiny-test" (vocab 96) presets. Model ids >= ``vocab_size`` (a model's vocab
may be larger) decode to U+FFFD, so that any sampled sequence decodes.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
CHARSET = "\n " + string.digits + string.ascii_lowercase + string.ascii_uppercase + ".,:;=>+-*?!()"
UNKNOWN_CHAR = "\ufffd"


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

    def __init__(self) -> None:
        self._char_to_id = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(CHARSET)}
        self._id_to_char = dict(enumerate(SPECIAL_TOKENS)) | {i: c for c, i in self._char_to_id.items()}

    @property
    def vocab_size(self) -> int:
        """Number of ids (specials + characters)."""
        return len(SPECIAL_TOKENS) + len(CHARSET)

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
