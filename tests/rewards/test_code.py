"""Code reward on the real HumanEval set and on stdin/stdout and assert-list specs."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest

from sparrow_nemo.rewards import get_reward
from sparrow_nemo.rewards.code import code_reward, code_rewards, extract_code, outputs_match
from sparrow_nemo.tasks import chain  # noqa: F401  (registers the 'chain' reward)


def _humaneval(shared_data: Path) -> list[dict]:
    with gzip.open(shared_data / "humaneval.jsonl.gz", "rt") as fh:
        return [json.loads(line) for line in fh]


def _spec(row: dict, **extra: object) -> dict:
    return {
        "format": "humaneval",
        "prompt": row["prompt"],
        "test": row["test"],
        "entry_point": row["entry_point"],
    } | extra


#: correctness tests, not speed tests: wide limits so a loaded shared CPU cannot fail a good solution
GENEROUS = {"wall_s": 60.0, "cpu_s": 30}


def test_every_canonical_humaneval_solution_passes(sandbox: None, shared_data: Path) -> None:
    rows = _humaneval(shared_data)
    assert len(rows) == 164
    specs = [_spec(r, limits=GENEROUS) for r in rows]
    rewards = code_rewards([r["canonical_solution"] for r in rows], specs, workers=2)
    assert [r["task_id"] for r, x in zip(rows, rewards) if x != 1.0] == []


def test_a_solution_to_another_task_fails(sandbox: None, shared_data: Path) -> None:
    rows = _humaneval(shared_data)
    wrong = [rows[(i + 1) % len(rows)]["canonical_solution"] for i in range(len(rows))]
    rewards = code_rewards(wrong, [_spec(r, limits=GENEROUS) for r in rows], workers=2)
    assert [r["task_id"] for r, x in zip(rows, rewards) if x != 0.0] == []


def test_whole_function_in_a_fence_and_hostile_completions(sandbox: None, shared_data: Path) -> None:
    row = _humaneval(shared_data)[2]  # truncate_number(number) -> number % 1.0
    spec = _spec(row, limits={"wall_s": 30.0, "cpu_s": 2, "output_bytes": 65536})  # the CPU limit ends loops
    fenced = "Here:\n```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```\n"
    assert code_reward(fenced, spec) == 1.0
    for hostile in (
        "    import sys\n    sys.exit(0)\nimport sys\nsys.exit(0)\n",  # exits before check() runs
        "    return 0.5\nimport os\nos._exit(0)\n",
        "    while True:\n        pass\n",
        "    import os\n    while True:\n        os.fork()\n",
        "    print('x' * 10 ** 7)\n    return number % 1.0\n",
        "    open('/tmp/sparrow_pwned', 'w')\n    return number % 1.0\n",
    ):
        assert code_reward(hostile, spec) == 0.0, hostile
    assert not Path("/tmp/sparrow_pwned").exists()


SUM_SPEC = {"format": "stdio", "inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7", "6\n"]}
SUM = "a, b = map(int, input().split())\nprint(a + b)\n"


def test_stdio_fraction_and_all_modes(sandbox: None) -> None:
    assert code_reward(SUM, SUM_SPEC) == pytest.approx(2 / 3)  # the third expected output is wrong
    assert code_reward(SUM, SUM_SPEC | {"mode": "all"}) == 0.0
    good = SUM_SPEC | {"outputs": ["3", "7", "5"], "mode": "all"}
    assert code_reward(f"```python\n{SUM}```", good) == 1.0
    assert code_reward("import sys\nprint(sum(map(int, sys.stdin.read().split())))\nexit()\n", good) == 1.0
    assert code_reward("print(", good) == 0.0


def test_asserts_fraction(sandbox: None) -> None:
    spec = {
        "format": "asserts",
        "setup": "import math",
        "tests": [
            "assert sq(3) == 9",
            "assert sq(-2) == 4",
            "assert sq(0.5) == 0.3",
            "assert math.isclose(sq(1.5), 2.25)",
        ],
    }
    assert code_reward("def sq(x):\n    return x * x\n", spec) == pytest.approx(3 / 4)
    assert code_reward("def sq(x):\n    return x * x\nimport sys\nsys.exit(0)\n", spec) == 0.0


def test_tests_reach_program_objects_only_as_plain_values_and_handles(sandbox: None) -> None:
    """Classes and instances stay in the program's sandbox (handles), in-place changes of list arguments
    come back, exceptions arrive by builtin name, standard modules are the checker's own."""
    program = (
        "class Pair:\n"
        "    def __init__(self, a, b):\n"
        "        self.a, self.b = a, b\n"
        "    def total(self):\n"
        "        return self.a + self.b\n"
        "def longest(pairs):\n"
        "    return max(p.total() for p in pairs)\n"
        "def sort_in_place(xs):\n"
        "    xs.sort()\n"
        "def check_positive(x):\n"
        "    if x <= 0:\n"
        "        raise ValueError('not positive')\n"
        "    return math.sqrt(x)\n"
        "import math\n"
    )
    tests = [
        "assert Pair(2, 3).total() == 5 and Pair(2, 3).a == 2",
        "assert longest([Pair(1, 2), Pair(5, 5)]) == 10",
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
        "try:\n    check_positive(-1)\n    raise AssertionError('no error')\nexcept ValueError:\n    pass",
        "assert math.isclose(check_positive(2.0), math.sqrt(2))",
        "assert Pair(1, 1) != Pair(1, 1)",  # identities of two remote objects: never equal here
    ]
    assert code_reward(program, {"format": "asserts", "tests": tests}) == 1.0


def test_extract_code_and_output_matching() -> None:
    text = "```js\nlet a\n```\n```python\nx = 1\n```\ntext\n```py\ny = 2\n```"
    assert extract_code(text) == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("plain = 1") == "plain = 1"
    assert outputs_match("1 2\n3\n", "1\n2 3")
    assert not outputs_match("1 2 3 4", "1 2 3")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"format": "humaneval", "prompt": "x"}, "missing the key 'test'"),
        ({"format": "stdio", "inputs": ["1"], "outputs": []}, "equally many"),
        ({"format": "asserts", "tests": "assert 1"}, "must be list"),
        ({"format": "java"}, "unknown code test format"),
        ({"format": "asserts", "tests": ["assert 1"], "mode": "best"}, "mode"),
        (
            {"format": "asserts", "tests": ["assert 1"], "limits": {"memory_mb": 512.5}},
            "'memory_mb' must be a pos",
        ),
        (
            {"format": "asserts", "tests": ["assert 1"], "limits": {"output_bytes": 1e6}},
            "'output_bytes' must be",
        ),
        (
            {"format": "asserts", "tests": ["assert 1"], "limits": {"wall_s": float("nan")}},
            "'wall_s' must be a positive number of seconds up to 600",
        ),
        (
            {"format": "asserts", "tests": ["assert 1"], "limits": {"wall_s": float("inf")}},
            "'wall_s' must be a positive number of seconds up to 600",
        ),
        # a data row cannot lift the caps: each limit has a maximum
        (
            {"format": "asserts", "tests": ["assert 1"], "limits": {"wall_s": 1e12, "memory_mb": 10**12}},
            r"'wall_s' must be a positive number of seconds up to 600.0, got 1000000000000.0",
        ),
        (
            {"format": "asserts", "tests": ["assert 1"], "limits": {"memory_mb": 10**12}},
            r"'memory_mb' must be a positive integer up to 16384, got 1000000000000",
        ),
        ({"format": "asserts", "tests": ["assert 1"], "limits": {"swap_mb": 1}}, "unexpected keyword"),
        ({"format": "stdio", "inputs": [1], "outputs": ["1"]}, "list of strings"),
    ],
)
def test_bad_specs(spec: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        code_reward("x = 1", spec)


def test_registry_exposes_the_rewards() -> None:
    assert get_reward("code") is code_reward
    assert get_reward("math")("\\boxed{2}", "2") == 1.0
    assert get_reward("chain")("Bc7=7 C.\n!C7", "C7") == 1.0
    with pytest.raises(KeyError, match="known: chain, code, math"):
        get_reward("bleu")


def test_a_flood_of_blank_lines_is_read_in_linear_time(sandbox: None) -> None:
    """HumanEval's search for the completion's own ``def`` once took 11 s for 120,000 newlines (a ``\\s*``
    at each line start rescanned the rest); 2,000,000 would take hours. Linear, it is milliseconds: the
    bound is for a loaded machine, not a speed claim."""
    spec = {
        "format": "humaneval",
        "prompt": 'def f(x):\n    """x + 1"""\n',
        "test": "def check(candidate):\n    assert candidate(1) == 2\n",
        "entry_point": "f",
        "limits": {"wall_s": 60.0, "output_bytes": 65536},
    }
    start = time.monotonic()
    assert code_reward("\n" * 2_000_000 + "def f(x):\n    return x + 1\n", spec) == 1.0
    assert time.monotonic() - start < 120
