"""Find the final answer in a completion: linear-time scans, no backtracking regex over model text.

What is scored (:func:`scored_part`): the text after the last ``</think>`` when the completion has one; a
completion that opened ``<think>`` and never closed it has no answer (a truncated response is not rewarded
for a value inside its thinking); one without thinking tags is scored whole. ``score_thinking=True``
scores the whole completion.

Where the answer is (:func:`extract_final_answer`), first match wins:

1. the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces), or ``\\boxed X``;
2. the recipe's own pattern (``answer_pattern``: a regex whose first group is the answer, matched line by
   line from the end with the ``regex`` module's timeout);
3. the last line starting with ``Answer:`` (DAPO-Math's instruction: "the last line of your response should
   be of the form Answer: $Answer"), markdown bold allowed (``**Answer:** 5``);
4. the last "final answer: X" / "the final answer is X" phrase.

Hostile text (a policy can emit anything): every scan is a ``str.rfind`` or a walk over at most
:data:`MAX_SCAN_LINES` lines of at most :data:`MAX_LINE_CHARS` characters each; an answer longer than
:data:`MAX_ANSWER_CHARS` is no answer.
"""

from __future__ import annotations

import re

#: an extracted answer longer than this (characters) is refused: no real final answer is this long
MAX_ANSWER_CHARS = 1_000
#: the line scans look at this many lines from the end of the scored text
MAX_SCAN_LINES = 200
#: and at most this many characters of each line (its end: the answer is at a line's end)
MAX_LINE_CHARS = 2_000
#: seconds the recipe's own pattern may take on one line (``regex`` module timeout)
PATTERN_TIMEOUT_S = 0.1

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
# anchored at the line start, one optional run of each kind, no two quantifiers over the same characters
_ANSWER_LINE = re.compile(r"(?:\*\*)?answer(?:\*\*)?:(?:\*\*)?(.*)", re.IGNORECASE)
_FINAL_PHRASE = "final answer"


def scored_part(completion: str, score_thinking: bool = False) -> str | None:
    """The part of ``completion`` whose answer counts (module docstring); None = no answer part."""
    if score_thinking:
        return completion
    close = completion.rfind(_THINK_CLOSE)
    if close >= 0:
        return completion[close + len(_THINK_CLOSE) :]
    if _THINK_OPEN in completion:
        return None  # thinking never closed: truncated, nothing to score
    return completion


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (braces balanced), or of
    ``\\boxed X`` (up to the next space or ``$``); None when there is none or its braces never close."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if i < len(text) and text[i] == " ":
        word = text[i + 1 : i + 1 + MAX_ANSWER_CHARS + 1]
        ends = [j for j in (word.find(c) for c in " \n\t$") if j >= 0]
        return word[: min(ends, default=len(word))] or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, min(len(text), i + MAX_ANSWER_CHARS + 2)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _last_lines(text: str) -> list[str]:
    """The last :data:`MAX_SCAN_LINES` lines of ``text``, last first, each cut to its last
    :data:`MAX_LINE_CHARS` characters (blank lines skipped)."""
    lines: list[str] = []
    end = len(text)
    while end > 0 and len(lines) < MAX_SCAN_LINES:
        start = text.rfind("\n", 0, end) + 1
        line = text[max(start, end - MAX_LINE_CHARS) : end].strip()
        if line:
            lines.append(line)
        end = start - 1
    return lines


def _clean(answer: str) -> str | None:
    """Strip spaces, ``$`` and a trailing period; None when empty or too long."""
    answer = answer.strip().rstrip(".").strip().strip("$").strip()
    return answer if answer and len(answer) <= MAX_ANSWER_CHARS else None


def _pattern_answer(lines: list[str], pattern: str) -> str | None:
    import regex  # a transformers dependency; its matcher honours a timeout

    compiled = regex.compile(pattern)
    for line in lines:
        try:
            m = compiled.search(line, timeout=PATTERN_TIMEOUT_S)
        except TimeoutError:
            return None
        if m:
            return m.group(1) if compiled.groups else m.group(0)
    return None


def _answer_line(lines: list[str]) -> str | None:
    for line in lines:
        m = _ANSWER_LINE.match(line)
        if m:
            return m.group(1).replace("**", "")
    return None


def _final_phrase(lines: list[str]) -> str | None:
    for line in lines:
        at = line.lower().rfind(_FINAL_PHRASE)
        if at < 0:
            continue
        rest = line[at + len(_FINAL_PHRASE) :].lstrip()
        if rest.lower().startswith("is"):
            rest = rest[2:].lstrip()
        return rest.lstrip(":")
    return None


def extract_final_answer(
    text: str, answer_pattern: str | None = None, score_thinking: bool = True
) -> str | None:
    """The final answer of ``text`` (module docstring: box, the recipe's pattern, ``Answer:`` line, "final
    answer" phrase), stripped of ``$``, spaces and a trailing period; None when none is found.

    ``score_thinking`` False: only the part after ``</think>`` (:func:`scored_part`)."""
    part = scored_part(text, score_thinking)
    if part is None:
        return None
    boxed = extract_boxed(part)
    if boxed is not None:
        return _clean(boxed)
    lines = _last_lines(part)
    for found in (
        _pattern_answer(lines, answer_pattern) if answer_pattern else None,
        _answer_line(lines),
        _final_phrase(lines),
    ):
        if found is not None:
            return _clean(found)
    return None


def check_pattern(pattern: str) -> None:
    """A ValueError naming the problem when ``pattern`` is not a regex with at most one group."""
    import regex

    try:
        compiled = regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(f"answer_pattern {pattern!r} is not a regular expression ({exc})") from None
    if compiled.groups > 1:
        raise ValueError(f"answer_pattern {pattern!r}: at most one group (the answer), got {compiled.groups}")
