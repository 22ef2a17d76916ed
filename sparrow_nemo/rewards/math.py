"""Math answer reward: find the completion's final answer and check it against the gold answer.

Extraction (:mod:`sparrow_nemo.rewards.answer_text`): the part after ``</think>`` (the thinking is not scored
unless ``score_thinking``), then the last ``\\boxed{}``, the recipe's ``answer_pattern``, DAPO's ``Answer:``
line, or a "final answer" phrase.

Equivalence: ``math_verify`` (``parse`` + ``verify``: symbolic and numeric, sets, intervals, matrices,
LaTeX) on a single value, with the rules it lacks:

- an answer is read as one value: an equation, inequality or other relation (``6 = 5``, ``3 \\mid 5``,
  ``x \\le 2``), a logical form (``\\neg 5``, ``3 \\lor 5``) or a percent (``5\\%``) is not a number, so it
  is wrong unless the gold answer has the same kind of operator. One exception, the usual answer form: a
  variable named on the left of a single ``=`` (``x = 5``, ``a_1 = 5``) is read as its right side;
- a gold percent (``5\\%``) takes the number with or without the sign; a predicted percent needs a gold one;
- Unicode is NFKC-normalised (``5․5`` with U+2024 is ``5.5``), the usual math symbols are mapped to LaTeX
  (``−``, ``×``, ``÷``, ``·``, ``π``, ``∞``, ``√``, ``≤``, ``≥``, ``≠``, ``¬``, ``∨``, ``∧``), and an answer still
  holding a non-ASCII character that the gold answer does not is refused (zero-width and other invisibles too);
- base-n numerals such as ``52_8`` must match digits and base exactly (math_verify drops the base).

Time limit: one deadline of ``timeout_s`` per answer covers extraction, parsing and verification. In the
main thread it is a ``SIGALRM`` timer (math_verify's own alarms are off, so they cannot cancel it); in any
other thread the answer is checked in a spawned worker process that is killed at the deadline. A timeout,
an answer over :data:`~sparrow_nemo.rewards.answer_text.MAX_ANSWER_CHARS` or any error scores 0.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from sparrow_nemo.rewards.answer_text import check_pattern, extract_boxed, extract_final_answer
from sparrow_nemo.rewards.math_check import judge

__all__ = ["extract_boxed", "extract_final_answer", "math_equal", "math_reward"]


class _Deadline(BaseException):
    """The answer's time limit passed (a BaseException: math_verify's and sympy's ``except Exception`` must not
    swallow it and go on without a limit)."""


@contextlib.contextmanager
def _alarm(timeout_s: float | None) -> Iterator[None]:
    """Raise :class:`_Deadline` in the main thread after ``timeout_s`` seconds (None: no limit)."""
    if not timeout_s:
        yield
        return

    def expire(_signum, _frame):
        raise _Deadline

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, float(timeout_s))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _judged(task: str, args: tuple, timeout_s: float | None) -> bool:
    """:func:`~sparrow_nemo.rewards.math_check.judge` within ``timeout_s`` (module docstring); False on a timeout or any error."""
    if threading.current_thread() is not threading.main_thread():
        from sparrow_nemo.rewards.math_worker import judge_in_worker

        return judge_in_worker(task, args, timeout_s)
    try:
        with _alarm(timeout_s):
            return judge(task, args)
    except (_Deadline, Exception):  # or math_verify / sympy on pathological input (recursion, sympy errors)
        return False


def math_equal(pred: str, gold: str, timeout_s: float | None = 5) -> bool:
    """True when the answer string ``pred`` is mathematically equivalent to the gold answer string ``gold``
    (both LaTeX without the surrounding ``$``; module docstring); False on any parse failure or timeout."""
    return _judged("equal", (pred, gold), timeout_s)


def math_reward(
    completion: str,
    gold: str,
    timeout_s: float | None = 5,
    answer_pattern: str | None = None,
    score_thinking: bool = False,
) -> float:
    """1.0 when the completion's final answer equals ``gold``, else 0.0 (module docstring).

    Options (``reward.options``): ``timeout_s`` per answer (seconds; null = no limit), ``answer_pattern`` (the
    recipe's own answer regex, first group = the answer), ``score_thinking`` (also look inside ``<think>``).
    """
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"math_reward: gold answer must be a non-empty string, got {gold!r}")
    if answer_pattern is not None:
        check_pattern(answer_pattern)
    return 1.0 if _judged("reward", (completion, gold, answer_pattern, score_thinking), timeout_s) else 0.0
