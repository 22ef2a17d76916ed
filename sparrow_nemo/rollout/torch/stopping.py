"""When a response ends: a stop token, a stop string in the decoded text, or the length cap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sparrow_nemo.rollout.engine import FinishReason


class Detokenizer(Protocol):
    """What stop strings need from a tokenizer."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class StopRule:
    """The stop conditions of one generate() call.

    Attributes:
        stop_ids: token ids that end a response (the token is kept).
        stop_strings: texts that end a response once its decoded text contains one.
        tokenizer: decodes responses for the stop strings (required when there are any).
    """

    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    tokenizer: Detokenizer | None = None

    def __post_init__(self) -> None:
        if self.stop_strings and self.tokenizer is None:
            raise ValueError(
                "SamplingParams.stop_strings needs an engine tokenizer (TorchRolloutEngine(tokenizer=...))"
            )

    def check(self, response: list[int], max_new: int) -> tuple[FinishReason, int | str | None] | None:
        """Why ``response`` (token ids so far, the newest last) ends now, or None to continue.

        Precedence: stop token, then stop string (the whole response text is decoded, so strings that
        span tokens are found), then the length cap ``max_new`` tokens.
        """
        token = response[-1]
        if token in self.stop_ids:
            return "stop_token", token
        if self.stop_strings:
            text = self.tokenizer.decode(response)
            for s in self.stop_strings:
                if s in text:
                    return "stop_string", s
        if len(response) >= max_new:
            return "length", None
        return None
