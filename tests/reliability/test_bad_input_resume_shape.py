"""Resuming from a checkpoint of another model shape: one line naming it and the differing fields, exit 2,
and the run folder is not created (no ``config.yaml`` / ``config_hash.txt`` left to block the next try)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sparrow_nemo.cli import main
from sparrow_nemo.grpo.recipe import load_config


def test_resume_from_another_shape_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shape = dataclasses.asdict(load_config("tiny_cpu_short_smoke", []).model.shape())
    other = tmp_path / "other" / "step_00000003"
    other.mkdir(parents=True)
    manifest = {"format_version": 2, "step": 3, "shape": {**shape, "num_layers": shape["num_layers"] + 2}}
    (other / "manifest.json").write_text(json.dumps({**manifest, "files": {}}))
    run_dir = tmp_path / "run"
    status = main(
        ["train", "--config", "tiny_cpu_short_smoke", "--run-dir", str(run_dir), f"checkpoint.resume={other}"]
    )
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "sparrow train: no checkpoint to resume from has this run's model"
    )
    assert f"{other}: {{'num_layers': ({shape['num_layers'] + 2}, {shape['num_layers']})}}" in err[0]
    assert not run_dir.exists()
