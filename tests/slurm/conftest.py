"""A private single-node Slurm for the tests in this folder (scripts/ci_slurm_setup.sh), or a skip with the reason."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SETUP = REPO_ROOT / "scripts" / "ci_slurm_setup.sh"


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment (``SLURM_CONF`` set) for the Slurm commands of a freshly started local cluster.

    Skips, naming the reason, when the daemons cannot run here (not Linux, not root, no apt-get,
    a daemon that does not start). The daemons are stopped afterwards.
    """
    if not sys.platform.startswith("linux"):
        pytest.skip("the local Slurm test needs Linux (slurm-wlm + munge)")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm test starts slurmctld/slurmd as root (SlurmdUser=root); not root here")
    state = tmp_path_factory.mktemp("slurm_state")
    try:
        started = subprocess.run(
            ["bash", str(SETUP), "start", str(state)], capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/ci_slurm_setup.sh start did not finish within 900 s")
    if started.returncode != 0:
        lines = started.stderr.strip().splitlines() or ["no message"]
        pytest.skip(f"local Slurm could not start: {lines[-1]}")
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SETUP), "stop", str(state)], capture_output=True, text=True, timeout=120)


def load_script(name: str) -> types.ModuleType:
    """The module ``scripts/<name>.py`` (scripts/ is not a package)."""
    module_name = f"sparrow_scripts_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module
