"""The run folder (resolved config + hash) and the trainer-state file saved next to each policy checkpoint."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from sparrow_nemo.config import SparrowConfig
from sparrow_nemo.policy.checkpoint import atomic_write_bytes

TRAINER_STATE = "trainer_state.json"


def make_run_dir(config: SparrowConfig, run_dir: str | Path | None = None) -> Path:
    """Create the run folder and write ``config.yaml`` (the resolved recipe) and ``config_hash.txt``.

    ``run_dir`` given: used as is. Otherwise ``<logging.run_dir or runs>/<name>-<UTC timestamp>``.
    """
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        run_dir = Path(config.logging.run_dir or "runs") / f"{config.name}-{stamp}"
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(
        f"# sparrow config '{config.name}', hash {config.hash()}\n{config.to_yaml()}"
    )
    (path / "config_hash.txt").write_text(config.hash() + "\n")
    return path


def save_trainer_checkpoint(
    step_dir: Path, state: dict[str, Any], callbacks: dict[str, Any], keep_last: int
) -> None:
    """Write ``trainer_state.json`` into a finished policy checkpoint folder; drop all but the newest ``keep_last``."""
    payload = {"trainer": state, "callbacks": callbacks}
    atomic_write_bytes(step_dir / TRAINER_STATE, (json.dumps(payload, indent=2) + "\n").encode())
    steps = sorted(p for p in step_dir.parent.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
