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


# ----- issue 37: DAPO's Answer: line, the thinking, the recipe's own pattern -----------------------------
@pytest.mark.parametrize(
    ("completion", "gold", "reward"),
    [
        ("Let me think...\nAnswer: 34", "34", 1.0),  # DAPO-Math-17k's instruction format
        ("**Answer:** $\\frac{1}{2}$", "0.5", 1.0),
        ("Answer: 33", "34", 0.0),
        ("<think>so \\boxed{34}</think>\nThe sum is 34.", "34", 0.0),  # the thinking's box does not count
        ("<think>so \\boxed{34} and then it ran out of toke", "34", 0.0),  # unclosed thinking: no answer
        ("<think>maybe 3</think>\nAnswer: 34", "34", 1.0),
        ("<think>\n\n</think>\n\n\\boxed{34}", "34", 1.0),  # Qwen3 with enable_thinking=false
    ],
)
def test_answer_lines_and_thinking(completion: str, gold: str, reward: float) -> None:
    assert math_reward(completion, gold) == reward


def test_score_thinking_knob_and_recipe_pattern() -> None:
    assert math_reward("<think>\\boxed{34}", "34", score_thinking=True) == 1.0
    text = "work...\nRESULT => 34 <="
    assert math_reward(text, "34") == 0.0
    assert math_reward(text, "34", answer_pattern=r"RESULT => (.+) <=") == 1.0
    with pytest.raises(ValueError, match="at most one group"):
        math_reward(text, "34", answer_pattern=r"(R)(E)")
    with pytest.raises(ValueError, match="is not a regular expression"):
        math_reward(text, "34", answer_pattern=r"(unclosed")


def test_a_catastrophic_recipe_pattern_times_out_per_line() -> None:
    t0 = time.perf_counter()
    assert math_reward("a" * 1_000 + "!", "1", answer_pattern=r"(a+)+$") == 0.0
    assert time.perf_counter() - t0 < 10.0  # unbounded, (a+)+$ on 1,000 a's takes longer than the universe


# ----- issue 40: wrong answers scored right, ReDoS --------------------------------------------------------
@pytest.mark.parametrize(
    ("pred", "gold", "reward"),
    [
        ("6 = 5", "5", 0.0),  # an equation is not the number on its right
        ("3 \\mid 5", "5", 0.0),
        ("\\neg 5", "5", 0.0),
        ("3 \\lor 5", "5", 0.0),
        ("3 \\vee 5", "5", 0.0),
        ("5 \\le 6", "5", 0.0),
        ("5\\%", "5", 0.0),  # a percent is not the number
        ("5\\%", "0.05", 0.0),
        ("5%", "0.05", 0.0),
        ("5․5", "5", 0.0),  # U+2024 ONE DOT LEADER: NFKC makes it 5.5
        ("5․5", "5.5", 1.0),
        ("5\u200b", "5", 0.0),  # a zero-width space the gold does not have
        ("５", "5", 1.0),  # fullwidth digit: NFKC
        ("x = 5", "5", 1.0),  # a variable named on the left: its value
        ("a_1 = 5", "5", 1.0),
        ("x = 6 = 5", "5", 0.0),
        ("5", "5\\%", 1.0),  # a gold percent takes the number with or without the sign
        ("5\\%", "5\\%", 1.0),
        ("x \\le 3", "x \\le 3", 1.0),  # the gold is a relation: relations compare
        ("\\left| -3 \\right|", "3", 1.0),  # |x| is a value, not a relation
    ],
)
def test_one_value_rules(pred: str, gold: str, reward: float) -> None:
    assert math_reward(f"\\boxed{{{pred}}}", gold) == reward


def test_hostile_whitespace_runs_are_linear() -> None:
    """2,400 newlines took 16.7 s in the old final-answer regex (cubic), 60,000 spaces 8.4 s in the base-numeral
    one; these inputs are 10-20x larger: a super-linear scan would not end within the bound."""
    t0 = time.perf_counter()
    assert math_reward("final answer" + "\n" * 50_000 + "x", "5") == 0.0
    assert math_reward("The final answer:" + " \n" * 50_000, "5") == 0.0
    assert math_reward("Answer:" + "\t" * 200_000 + "y", "5") == 0.0
    assert math_equal("5_8" + " " * 600_000 + "x", "5_8") is False
    assert math_equal("5_{" + " " * 600_000 + "8}", "5_8") is False
    assert math_reward("\\boxed{" + "{" * 200_000, "5") == 0.0
    assert time.perf_counter() - t0 < 20.0


def test_thread_timeout_kills_the_worker_and_the_next_answer_scores() -> None:
    """Outside the main thread the answer is checked in a worker process that the deadline kills."""
    out: list[float] = []

    def work() -> None:
        out.append(math_reward("\\boxed{9^{9^{9^{9^{9}}}}}", "9^{9^{9^{9^{8}}}}", timeout_s=1))
        out.append(math_reward("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", timeout_s=60))

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(timeout=300)
    assert out == [0.0, 1.0]
