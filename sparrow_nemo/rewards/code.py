"""Code reward: run a completion against tests in the sandbox (:mod:`sparrow_nemo.rewards.code_sandbox`).

Test specs (the ``ground_truth`` of the reward registry), one dict per problem:

- HumanEval: ``{"format": "humaneval", "prompt": str, "test": str, "entry_point": str}``. The program is
  ``prompt + completion`` (or ``prompt`` followed by the completion's own ``def entry_point``); ``check``
  of ``test`` is called with it; one case.
- stdin/stdout (TACO, code-r1 style): ``{"format": "stdio", "inputs": [str], "outputs": [str]}``; one
  sandbox per case; the output matches when its whitespace-separated tokens equal the expected ones.
- assert lists (MBPP, code-r1 style): ``{"format": "asserts", "tests": [str], "setup": str (optional)}``;
  the program is the solution followed by ``setup``; one case per assert statement.

Where verdicts are decided: a stdio program's output is compared here, in the trainer; tests (HumanEval
checks, asserts) run in a checker sandbox that holds no model code, against the program in its own sandbox,
through plain values only (:mod:`sparrow_nemo.rewards.code_checker`). The model's program never sees a
test or an expected output. The ``prompt`` and ``setup`` of a spec run on both sides (the checker trusts
the helpers they define); everything else the tests name is taken from the program.

Shorthands (what code datasets store): a list of assert statements is an ``asserts`` spec, and a JSON string
holding a spec or such a list (Parquet columns often do) is parsed; :func:`parse_test_spec` turns either into
the dict, checking it, so a prompt loader can refuse a bad row up front.

Optional keys in every spec: ``"mode"`` ("fraction": passed cases / cases, the default; "all": 1.0 only if
every case passes, stopping at the first failure) and ``"limits"`` (a dict of
:class:`~sparrow_nemo.rewards.code_sandbox.SandboxLimits` fields, each a positive integer, ``wall_s`` a
positive number, none above its :data:`~sparrow_nemo.rewards.code_sandbox.LIMIT_MAXIMA` entry).

The reward runs model code only in the OS sandbox (:mod:`sparrow_nemo.rewards.sandbox_os`); where that
cannot be had it raises :class:`~sparrow_nemo.rewards.sandbox_os.SandboxUnavailable`, naming what is
missing, unless the recipe sets ``reward.options.sandbox: unsafe_local`` (no isolation at all).

The code is the last fenced ```python block of the completion (or the last fenced block of any language),
else the whole completion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sparrow_nemo.rewards.code_checker import run_tests
from sparrow_nemo.rewards.code_sandbox import SandboxLimits, run_python
from sparrow_nemo.rewards.sandbox_os import require

_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_MODES = ("fraction", "all")
#: ``reward.options.sandbox``: "os" (the OS sandbox, required by default) or "unsafe_local" (none at all)
SANDBOX_MODES = ("os", "unsafe_local")


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


def _strings(spec: dict, key: str) -> list[str]:
    values = _require(spec, key, list)
    if not all(isinstance(v, str) for v in values):
        raise ValueError(f"code test spec key '{key}' must be a list of strings")
    return values


def _humaneval_program(code: str, spec: dict) -> str:
    """The prompt with the completion: a whole function replaces the prompt's stub, a body completes it."""
    prompt, entry = _require(spec, "prompt", str), _require(spec, "entry_point", str)
    # [ \t], not \s: a \s* at each line start would rescan every following blank line (quadratic)
    if re.search(rf"^[ \t]*def[ \t]+{re.escape(entry)}[ \t]*\(", code, re.MULTILINE):
        return f"{prompt}\n\n{code}\n"
    return prompt + code + "\n"


def _check_format(spec: dict) -> None:
    """The spec's format and its keys (ValueError naming what is wrong)."""
    fmt = spec.get("format")
    if fmt == "humaneval":
        _require(spec, "prompt", str), _require(spec, "test", str), _require(spec, "entry_point", str)
    elif fmt == "stdio":
        inputs, outputs = _strings(spec, "inputs"), _strings(spec, "outputs")
        if len(inputs) != len(outputs) or not inputs:
            raise ValueError(
                f"stdio spec needs equally many inputs and outputs (> 0), got {len(inputs)}, {len(outputs)}"
            )
    elif fmt == "asserts":
        if not _strings(spec, "tests"):
            raise ValueError("asserts spec has an empty 'tests' list")
        if not isinstance(spec.get("setup", ""), str):
            raise ValueError("code test spec key 'setup' must be str")
    else:
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
    _check_format(value)
    return value


def outputs_match(actual: str, expected: str) -> bool:
    """Whitespace-insensitive comparison: equal lists of whitespace-separated tokens."""
    return actual.split() == expected.split()


def _stdio_verdicts(code: str, spec: dict, limits: SandboxLimits, stop: bool, unsafe: bool) -> list[bool]:
    verdicts = []
    for stdin, expected in zip(spec["inputs"], spec["outputs"]):
        result = run_python(code, stdin, limits, unsafe=unsafe)
        verdicts.append(result.ok and outputs_match(result.stdout, expected))
        if stop and not verdicts[-1]:
            break
    return verdicts


def _job(code: str, spec: dict, stop: bool) -> tuple[str, dict]:
    """(program for the program's sandbox, job for the checker's) of a humaneval or asserts spec."""
    if spec["format"] == "humaneval":
        job = {"kind": "humaneval", "prompt": spec["prompt"], "test": spec["test"], "cases": 1}
        return _humaneval_program(code, spec), job | {
            "entry_point": spec["entry_point"],
            "stop_on_failure": stop,
        }
    setup = spec.get("setup", "")
    job = {"kind": "asserts", "setup": setup, "tests": spec["tests"], "cases": len(spec["tests"])}
    return f"{code}\n\n{setup}\n", job | {"stop_on_failure": stop}


def check_sandbox(options: dict[str, Any]) -> None:
    """Start-up check of ``reward.options`` (:func:`~sparrow_nemo.rewards.registry.bind_reward` calls it):
    a known ``sandbox`` mode, and for "os" a sandbox that really starts here.

    Raises:
        ValueError: an unknown mode; SandboxUnavailable (a ValueError): no OS sandbox, naming what is missing.
    """
    sandbox = options.get("sandbox", "os")
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"reward.options.sandbox must be one of {SANDBOX_MODES}, got {sandbox!r}")
    if sandbox == "os":
        require()


def code_reward(completion: str, spec: Any, mode: str | None = None, sandbox: str = "os") -> float:
    """Reward in [0, 1] of ``completion`` on ``spec`` (a dict, or a :func:`parse_test_spec` shorthand).

    ``mode`` ("fraction" or "all", the recipe's ``reward.options.mode``) overrides the spec's own;
    ``sandbox`` (``reward.options.sandbox``): see :data:`SANDBOX_MODES`.

    Raises:
        SandboxUnavailable: ``sandbox="os"`` and OS isolation cannot be had here (the message says why).
    """
    spec = parse_test_spec(spec)
    if mode is not None and mode not in _MODES:
        raise ValueError(f"code reward mode must be one of {_MODES}, got {mode!r}")
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"reward.options.sandbox must be one of {SANDBOX_MODES}, got {sandbox!r}")
    mode = mode or spec.get("mode", "fraction")
    limits = SandboxLimits(**spec.get("limits", {}))
    code, stop, unsafe = extract_code(completion), mode == "all", sandbox == "unsafe_local"
    if spec["format"] == "stdio":
        verdicts = _stdio_verdicts(code, spec, limits, stop, unsafe)
        cases = len(spec["inputs"])
    else:
        program, job = _job(code, spec, stop)
        verdicts = [v is None for v in run_tests(program, job, limits, unsafe)]
        cases = job["cases"]
    passed = sum(verdicts)
    if mode == "all":
        return 1.0 if passed == cases else 0.0
    return passed / cases


def code_rewards(
    completions: Sequence[str], specs: Sequence[Any], workers: int = 2, sandbox: str = "os"
) -> list[float]:
    """:func:`code_reward` for each (completion, spec) pair, ``workers`` sandboxes at a time."""
    if len(completions) != len(specs):
        raise ValueError(f"code_rewards: {len(completions)} completions but {len(specs)} specs")
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda c, s: code_reward(c, s, sandbox=sandbox), completions, specs))
