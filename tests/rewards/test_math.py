"""Math reward: extraction, math_verify equivalence on the real MATH-500 / AIME answers, timeouts."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow_nemo.rewards.math import extract_boxed, extract_final_answer, math_equal, math_reward


def _rows(shared_data: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (shared_data / name).read_text().splitlines() if line.strip()]


def _perturb(answer: str) -> str:
    """A wrong answer: the first digit +1 (mod 10); answers without digits get a different word or '+1'."""
    m = re.search(r"\d", answer)
    if m:
        j = m.start()
        return answer[:j] + str((int(answer[j]) + 1) % 10) + answer[j + 1 :]
    return "\\text{zzz}" if answer.startswith("\\text") else answer + "+1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{\\left\\{ 1, \\{2\\} \\right\\}}", "\\left\\{ 1, \\{2\\} \\right\\}"),
        ("$\\boxed 5$ done", "5"),
        ("\\fbox{x+1}", "x+1"),
        ("\\boxed{unclosed {", None),
        ("\\boxed", None),
        ("no box", None),
        ("\\boxed{}", ""),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("blah\nThe final answer is $42$.", "42"),
        ("Final Answer: 7\n", "7"),
        ("final answer: 1\nfinal answer is \\frac{3}{4}", "\\frac{3}{4}"),
        ("Final answer: 3 but \\boxed{4}", "4"),
        ("I give up.", None),
        ("Final answer: $ $", None),
    ],
)
def test_extract_final_answer(text: str, expected: str | None) -> None:
    assert extract_final_answer(text) == expected


def test_every_math500_answer_verifies_and_a_perturbed_one_does_not(shared_data: Path) -> None:
    rows = _rows(shared_data, "math500.jsonl")
    assert len(rows) == 500
    wrong_accepted, right_rejected = [], []
    for i, row in enumerate(rows):
        gold = row["answer"]
        # generous timeout: this checks equivalence, not speed, and the CPU may be shared
        if math_reward(f"Thus the answer is \\boxed{{{gold}}}.", gold, timeout_s=60) != 1.0:
            right_rejected.append((i, gold))
        if math_reward(f"\\boxed{{{_perturb(gold)}}}", gold, timeout_s=60) != 0.0:
            wrong_accepted.append((i, gold, _perturb(gold)))
    assert right_rejected == []
    assert wrong_accepted == []


def test_aime_integer_answers(shared_data: Path) -> None:
    for row in _rows(shared_data, "aime24.jsonl") + _rows(shared_data, "aime25.jsonl"):
        gold = row["answer"]
        n = int(gold)
        assert math_reward(f"so \\boxed{{{n}}}", gold) == 1.0
        assert math_reward(f"The final answer is {n}.", gold) == 1.0
        assert math_reward(f"\\boxed{{{n + 1}}}", gold) == 0.0
        assert math_reward(f"the answer is {n}", gold) == 0.0  # no box, no "final answer": not extracted


@pytest.mark.parametrize(
    ("pred", "gold", "equal"),
    [
        ("0.5", "\\frac{1}{2}", True),
        ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
        ("\\sqrt{8}", "2\\sqrt{2}", True),
        ("52_{8}", "52_8", True),
        ("52_9", "52_8", False),  # math_verify alone would accept: it drops the base
        ("42", "52_8", False),
        ("x", "3", False),
    ],
)
def test_math_equal_cases(pred: str, gold: str, equal: bool) -> None:
    assert math_equal(pred, gold) is equal


def test_timeout_returns_false_quickly() -> None:
    t0 = time.perf_counter()
    assert math_equal("9^{9^{9^{9^{9}}}}", "9^{9^{9^{9^{8}}}}", timeout_s=1) is False
    assert time.perf_counter() - t0 < 10.0  # without the timeout this takes hours


def test_works_outside_the_main_thread() -> None:
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}")))
    worker.start()
    worker.join(timeout=30)
    assert out == [1.0]


def test_bad_gold_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="gold answer"):
        math_reward("\\boxed{1}", "")


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("\\boxed{}()^_0123456789x+-final answer:$ ")), max_size=40))
def test_garbage_never_raises(text: str) -> None:
    assert math_reward(text, "12", timeout_s=2) in (0.0, 1.0)
