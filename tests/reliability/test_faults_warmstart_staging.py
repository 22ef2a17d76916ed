"""A warm-start save killed with SIGKILL leaves ``.<key>.partial-<host>-<pid>``: the next run removes it
(whether it trains or finds the cache), and leaves the staging folders of live processes and other hosts."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.warmstart import ensure_warm_start, warm_start_dir


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_staging_of_a_killed_save_is_removed_by_the_next_run(tmp_path: Path) -> None:
    config = load_config("tiny_cpu", [f"warmstart.cache_dir={tmp_path / 'cache'}"])
    source = build_prompt_source(config)
    target = warm_start_dir(config, source)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a finished warm-start: the run takes the cache
    host = socket.gethostname()
    dead, live = _dead_pid(), os.getpid()
    names = {
        "killed": f".{target.name}.partial-{host}-{dead}",
        "killed_old_name": f".{target.name}.partial-{dead}",
        "running": f".{target.name}.partial-{host}-{live}",
        "other_host": f".{target.name}.partial-elsewhere-{dead}",
    }
    for name in names.values():
        (target.parent / name).mkdir()
        (target.parent / name / "model.safetensors").write_bytes(b"half")
    assert ensure_warm_start(config, source, show_progress=False) == target
    left = sorted(p.name for p in target.parent.iterdir())
    assert left == sorted([target.name, names["running"], names["other_host"]])
