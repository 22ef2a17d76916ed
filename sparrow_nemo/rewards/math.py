"""Math answer reward: extract the final answer of a completion and check it against the gold answer.

Extraction: the last ``\\boxed{...}`` (or ``\\fbox{...}``, nested braces allowed, also ``\\boxed 5``); if
there is none, the last "final answer: X" / "the final answer is X" line. Equivalence: ``math_verify``
(``parse`` + ``verify``: symbolic and numeric, sets, intervals, matrices, LaTeX), plus one rule it lacks:
base-n numerals such as ``52_8`` must match digits and base exactly (math_verify drops the base).

Timeouts: ``math_verify`` bounds parsing and verification with SIGALRM, which only works in the main
thread; elsewhere (a thread pool) it runs without a time limit. A timeout or any error scores 0.
"""

from __future__ import annotations

import re
import threading

import math_verify

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_FINAL_ANSWER_RE = re.compile(r"final answer\s*(?:is|:)?\s*:?\s*(.+)", re.IGNORECASE)
_BASE_NUMERAL_RE = re.compile(r"^\s*(?:\\text\{)?([0-9A-Za-z]+)\}?_\{?\s*(\d+)\s*\}?\s*$")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (braces balanced), or of
    ``\\boxed X`` (up to the next space or ``$``); None when there is none or its braces never close."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if i < len(text) and text[i] == " ":
        rest = text[i + 1 :]
        return re.split(r"[\s$]", rest, maxsplit=1)[0] or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_final_answer(text: str) -> str | None:
    """The boxed answer if any, else the text after the last "final answer" phrase (stripped of ``$``,
    spaces and a trailing period); None when neither is present."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    found = _FINAL_ANSWER_RE.findall(text)
    if not found:
        return None
    answer = found[-1].strip().rstrip(".").strip().strip("$").strip()
    return answer or None


def _timeout(timeout_s: int | None) -> int | None:
    """math_verify's SIGALRM timeouts only work in the main thread."""
    return timeout_s if threading.current_thread() is threading.main_thread() else None


def _base_numeral(answer: str) -> tuple[str, int] | None:
    """(digits upper-cased, base) for answers like ``52_8`` / ``4210_{5}`` / ``\\text{AB}_{12}``; else None."""
    m = _BASE_NUMERAL_RE.match(answer)
    return (m.group(1).upper(), int(m.group(2))) if m else None


def math_equal(pred: str, gold: str, timeout_s: int | None = 5) -> bool:
    """True when the answer string ``pred`` is mathematically equivalent to the gold answer string ``gold``
    (both LaTeX without the surrounding ``$``); False on any parse failure or timeout (seconds)."""
    gold_base = _base_numeral(gold)
    if gold_base is not None:
        return _base_numeral(pred) == gold_base
    t = _timeout(timeout_s)
    try:
        gold_parsed = math_verify.parse(f"${gold}$", parsing_timeout=t)
        pred_parsed = math_verify.parse(f"\\boxed{{{pred}}}", parsing_timeout=t)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=t))
    except Exception:  # math_verify raises on pathological input (recursion, sympy errors, timeouts)
        return False


def math_reward(completion: str, gold: str, timeout_s: int | None = 5) -> float:
    """1.0 when the completion's final answer (see :func:`extract_final_answer`) equals ``gold``, else 0.0."""
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"math_reward: gold answer must be a non-empty string, got {gold!r}")
    pred = extract_final_answer(completion)
    return 1.0 if pred is not None and math_equal(pred, gold, timeout_s) else 0.0
