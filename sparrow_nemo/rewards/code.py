"""Code reward: run a completion against tests in the sandbox (:mod:`sparrow_nemo.rewards.code_sandbox`).

Test specs (the ``ground_truth`` of the reward registry), one dict per problem:

- HumanEval: ``{"format": "humaneval", "prompt": str, "test": str, "entry_point": str}``. The program is
  ``prompt + completion`` (or ``prompt`` followed by the completion's own ``def entry_point``), then
  ``test`` and ``check(entry_point)``, in one process; one case.
- stdin/stdout (TACO, code-r1 style): ``{"format": "stdio", "inputs": [str], "outputs": [str]}``; one process
  per case; the output matches when its whitespace-separated tokens equal the expected ones.
- assert lists (MBPP, code-r1 style): ``{"format": "asserts", "tests": [str], "setup": str (optional)}``;
  one process per assert statement, after the solution and ``setup``.

Shorthands (what code datasets store): a list of assert statements is an ``asserts`` spec, and a JSON string
holding a spec or such a list (Parquet columns often do) is parsed; :func:`parse_test_spec` turns either into
the dict, checking it, so a prompt loader can refuse a bad row up front.

Optional keys in every spec: ``"mode"`` ("fraction": passed cases / cases, the default; "all": 1.0 only if
every case passes, stopping at the first failure) and ``"limits"`` (a dict of
:class:`~sparrow_nemo.rewards.code_sandbox.SandboxLimits` fields).

The code is the last fenced ```python block of the completion (or the last fenced block of any language),
else the whole completion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sparrow_nemo.rewards.code_sandbox import SandboxLimits, run_python

_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_MODES = ("fraction", "all")


def extract_code(completion: str) -> str:
    """The last ```python fenced block, else the last fenced block, else ``completion`` itself."""
    blocks = _FENCE_RE.findall(completion)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else completion


def _require(spec: dict, key: str, kind: type) -> Any:
    if key not in spec:
        raise ValueError(f"code test spec (format '{spec.get('format')}') is missing the key '{key}'")
    value = spec[key]
    if not isinstance(value, kind):
        raise ValueError(f"code test spec key '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def _humaneval_program(code: str, spec: dict) -> str:
    prompt, test = _require(spec, "prompt", str), _require(spec, "test", str)
    entry = _require(spec, "entry_point", str)
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        body = f"{prompt}\n\n{code}"  # a whole function: it replaces the prompt's stub
    else:
        body = prompt + code
    return f"{body}\n\n{test}\n\ncheck({entry})\n"


def _cases(code: str, spec: dict) -> list[tuple[str, str, str | None, bool]]:
    """(program, stdin, expected stdout or None, exit_ok) per test case of ``spec``."""
    fmt = spec.get("format")
    if fmt == "humaneval":
        return [(_humaneval_program(code, spec), "", None, False)]
    if fmt == "stdio":
        inputs, outputs = _require(spec, "inputs", list), _require(spec, "outputs", list)
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(
                f"stdio spec needs equally many inputs and outputs (> 0), got {len(inputs)}, {len(outputs)}"
            )
        return [(code, str(i), str(o), True) for i, o in zip(inputs, outputs)]
    if fmt == "asserts":
        tests, setup = _require(spec, "tests", list), spec.get("setup", "")
        if not tests:
            raise ValueError("asserts spec has an empty 'tests' list")
        return [(f"{code}\n\n{setup}\n\n{t}\n", "", None, False) for t in tests]
    raise ValueError(f"unknown code test format {fmt!r}; expected 'humaneval', 'stdio' or 'asserts'")


def parse_test_spec(value: Any) -> dict:
    """A checked test-spec dict from a spec dict, a list of assert statements, or a JSON string of either.

    Raises:
        ValueError: one line saying what is wrong (unknown format, missing or ill-typed key, bad mode or
            limits, a string that is not JSON).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"code test spec string is not JSON ({exc.msg} at column {exc.colno})") from None
        if isinstance(value, str):
            raise ValueError("code test spec string holds a JSON string, expected an object or a list")
    if isinstance(value, list):
        if not all(isinstance(t, str) for t in value):
            raise ValueError("a code test list must hold assert statements (strings)")
        value = {"format": "asserts", "tests": value}
    if not isinstance(value, dict):
        raise ValueError(
            f"code test spec must be a dict, a list of asserts or a JSON string, got {type(value).__name__}"
        )
    mode = value.get("mode", "fraction")
    if mode not in _MODES:
        raise ValueError(f"code test spec 'mode' must be one of {_MODES}, got {mode!r}")
    limits = value.get("limits", {})
    if not isinstance(limits, dict):
        raise ValueError(f"code test spec 'limits' must be a dict, got {type(limits).__name__}")
    try:
        SandboxLimits(**limits)
    except TypeError as exc:
        raise ValueError(f"code test spec 'limits': {exc}") from None
    _cases("", value)  # format and its keys
    return value


def outputs_match(actual: str, expected: str) -> bool:
    """Whitespace-insensitive comparison: equal lists of whitespace-separated tokens."""
    return actual.split() == expected.split()


def code_reward(completion: str, spec: Any, mode: str | None = None) -> float:
    """Reward in [0, 1] of ``completion`` on ``spec`` (a dict, or a :func:`parse_test_spec` shorthand).

    ``mode`` ("fraction" or "all", the recipe's ``reward.options.mode``) overrides the spec's own.
    """
    spec = parse_test_spec(spec)
    if mode is not None and mode not in _MODES:
        raise ValueError(f"code reward mode must be one of {_MODES}, got {mode!r}")
    mode = mode or spec.get("mode", "fraction")
    limits = SandboxLimits(**spec.get("limits", {}))
    cases = _cases(extract_code(completion), spec)
    passed = 0
    for program, stdin, expected, exit_ok in cases:
        result = run_python(program, stdin, limits, exit_ok=exit_ok)
        ok = result.passed and (expected is None or outputs_match(result.stdout, expected))
        passed += ok
        if mode == "all" and not ok:
            return 0.0
    return passed / len(cases) if mode == "fraction" else 1.0


def code_rewards(completions: Sequence[str], specs: Sequence[Any], workers: int = 2) -> list[float]:
    """:func:`code_reward` for each (completion, spec) pair, ``workers`` sandboxes at a time."""
    if len(completions) != len(specs):
        raise ValueError(f"code_rewards: {len(completions)} completions but {len(specs)} specs")
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(code_reward, completions, specs))
