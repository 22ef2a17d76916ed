"""Whether a predicted math answer equals the gold one: a single value, normalised, then math_verify.

The rules (the reward's docstring, :mod:`sparrow_nemo.rewards.math`, states them for users) and the check of
one answer, :func:`judge`, without any time limit: :mod:`sparrow_nemo.rewards.math` runs it under a deadline
in the main thread, :mod:`sparrow_nemo.rewards.math_worker` in a worker process elsewhere.
"""

from __future__ import annotations

import re
import unicodedata

import math_verify

from sparrow_nemo.rewards.answer_text import MAX_ANSWER_CHARS, extract_final_answer

#: base numerals are short: longer strings are not one (and are never given to the regex)
_MAX_BASE_NUMERAL_CHARS = 64
_BASE_NUMERAL_RE = re.compile(r"(?:\\text\{)?([0-9A-Za-z]+)\}?_\{?(\d+)\}?")
_SYMBOLS = {
    "−": "-", "×": "\\times ", "÷": "\\div ", "·": "\\cdot ", "π": "\\pi ", "∞": "\\infty ", "√": "\\sqrt ",
    "≤": "\\le ", "≥": "\\ge ", "≠": "\\neq ", "¬": "\\neg ", "∨": "\\lor ", "∧": "\\land ",
}  # fmt: skip
#: operator kinds that make an answer something other than one value: (kind, LaTeX commands, characters)
_OPERATORS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "relation",
        (
            "\\neq", "\\ne", "\\le", "\\ge", "\\leq", "\\geq", "\\lt", "\\gt", "\\mid", "\\nmid", "\\equiv",
            "\\approx", "\\sim", "\\in", "\\notin", "\\subset", "\\subseteq", "\\supset", "\\to",
            "\\rightarrow", "\\Rightarrow", "\\implies", "\\iff", "\\Leftrightarrow", "\\perp", "\\parallel",
        ),
        "=<>",
    ),
    ("logic", ("\\neg", "\\lnot", "\\lor", "\\land", "\\vee", "\\wedge", "\\oplus"), ""),
    ("percent", ("\\%", "\\percent"), "%"),
)  # fmt: skip
_COMMAND = re.compile(r"\\[A-Za-z]+")
_ASSIGNED_VARIABLE = re.compile(r"[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?")


def normalize_unicode(answer: str) -> str:
    """NFKC form (look-alikes such as U+2024 become ASCII) with the usual math symbols as LaTeX."""
    text = unicodedata.normalize("NFKC", answer)
    for symbol, latex in _SYMBOLS.items():
        text = text.replace(symbol, latex)
    return text


def _operator_kinds(answer: str) -> set[str]:
    """The kinds of :data:`_OPERATORS` that occur in ``answer`` (commands matched as whole words)."""
    commands = set(_COMMAND.findall(answer))
    plain = _COMMAND.sub(" ", answer).replace("\\{", "").replace("\\}", "")
    kinds = set()
    for kind, latex, chars in _OPERATORS:
        if commands & set(latex) or any(c in plain for c in chars):
            kinds.add(kind)
    return kinds


def _single_value(pred: str, gold_kinds: set[str]) -> str | None:
    """``pred`` as one value to compare (module docstring), or None when it is a relation, logical form or
    percent that the gold answer is not."""
    kinds = _operator_kinds(pred)
    if kinds == {"relation"} and "relation" not in gold_kinds and pred.count("=") == 1:
        left, right = pred.split("=")
        if _ASSIGNED_VARIABLE.fullmatch(left.strip()) and not _operator_kinds(right):
            return right
    if kinds - gold_kinds:
        return None
    return pred


def _strip_percent(answer: str) -> str:
    return answer.replace("\\%", "").replace("%", "").replace("\\percent", "")


def _base_numeral(answer: str) -> tuple[str, int] | None:
    """(digits upper-cased, base) for answers like ``52_8`` / ``4210_{5}`` / ``\\text{AB}_{12}``; else None."""
    compact = "".join(answer.split())
    if len(compact) > _MAX_BASE_NUMERAL_CHARS:
        return None
    m = _BASE_NUMERAL_RE.fullmatch(compact)
    return (m.group(1).upper(), int(m.group(2))) if m else None


def _equal(pred: str, gold: str) -> bool:
    """:func:`math_equal` without the time limit (the caller holds it)."""
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    pred_n, gold_n = normalize_unicode(pred), normalize_unicode(gold)
    if not {c for c in pred_n if not c.isascii()} <= set(gold_n):  # a character the gold does not have
        return False
    gold_base = _base_numeral(gold_n)
    if gold_base is not None:
        return _base_numeral(pred_n) == gold_base
    gold_kinds = _operator_kinds(gold_n)
    value = _single_value(pred_n, gold_kinds)
    if value is None:
        return False
    if "percent" in gold_kinds:
        value, gold_n = _strip_percent(value), _strip_percent(gold_n)
    gold_parsed = math_verify.parse(f"${gold_n}$", parsing_timeout=None)
    pred_parsed = math_verify.parse(f"\\boxed{{{value}}}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None))


def judge(task: str, args: tuple) -> bool:
    """One answer's check, unlimited: ``task`` "reward" (completion, gold, answer_pattern, score_thinking) or
    "equal" (pred, gold)."""
    if task == "equal":
        return _equal(*args)
    completion, gold, answer_pattern, score_thinking = args
    pred = extract_final_answer(completion, answer_pattern, score_thinking)
    return pred is not None and _equal(pred, gold)
