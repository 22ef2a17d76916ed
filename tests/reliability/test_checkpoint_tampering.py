"""Tampered checkpoints whose manifest is consistent (its hashes recomputed): each is passed over for the older
one with a warning naming it and why, never resumed from, and nothing reads forever or runs code.

Two real one-rank checkpoints (``tiny-test`` policy) hold a trainer's state as the trainer writes it; the run's
``metrics.jsonl`` has the rows of steps 0 and 1. Each case tampers with ``step_00000002`` and recomputes the
manifest's sha256 of what it changed.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from policy._helpers import single_rank_env
from policy._scenarios import SETTINGS, make_batches, pg_loss

from sparrow_nemo.checkpoint.atomic import MANIFEST, CheckpointError, sha256_file
from sparrow_nemo.checkpoint.run_state import (
    CALLBACK_TENSORS,
    TRAINER_STATE,
    resume_candidates,
    write_run_state,
)
from sparrow_nemo.grpo.checkpoint import TrainerState, load_run_checkpoint
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.parallel import ParallelLayout
from sparrow_nemo.policy.policy import MegatronPolicy
from sparrow_nemo.run_io.metrics import MetricsWriter
from sparrow_nemo.sparse.schedule import BudgetSchedule

RNG_FILE = "rng_tp00_pp00_dp000.pt"
METADATA = "policy/.metadata"
COMMON = "policy/common.pt"


class _Payload:
    """Unpickling this runs ``os.system``: what a tampered checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _policy() -> MegatronPolicy:
    return MegatronPolicy(PRESETS["tiny-test"], ParallelLayout(), SETTINGS, "float32", seed=3)


def _state(step: int) -> dict:
    schedule = BudgetSchedule(bin_tokens=16, budgets=(32, 48), page_size=16, name="s")
    return TrainerState(step, schedule, prompt_cursor=8 * step, metrics_rows=step).to_dict()


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run folder: ``checkpoints/step_0000000{1,2}`` and a ``metrics.jsonl`` of steps 0 and 1."""
    root = tmp_path / "checkpoints"
    with single_rank_env():
        policy = _policy()
        try:
            for step in (1, 2):
                policy.train_step(make_batches(policy.spec.shape.vocab_size, n=2, seed=step), pg_loss)
                states = {"Cb": {"seen": step, "adapter": {"x": torch.full((2,), float(step))}}}
                policy.save(
                    root, step, lambda staging, s=step, c=states: write_run_state(staging, _state(s), c)
                )
        finally:
            policy.close()
    writer = MetricsWriter(tmp_path)
    for step in (0, 1):
        writer.write(step, {"reward/mean": 0.5 + step})
    return tmp_path


def _rehash(folder: Path, *names: str) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    for name in names:
        manifest["files"][name] = sha256_file(folder / name)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _edit_state(change: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    def tamper(folder: Path, tmp_path: Path) -> None:
        payload = json.loads((folder / TRAINER_STATE).read_text())
        change(payload)
        (folder / TRAINER_STATE).write_text(json.dumps(payload))
        _rehash(folder, TRAINER_STATE)

    return tamper


def _edit_manifest(text: Callable[[str], str]) -> Callable[[Path, Path], None]:
    def tamper(folder: Path, tmp_path: Path) -> None:
        (folder / MANIFEST).write_text(text((folder / MANIFEST).read_text()))

    return tamper


def _both_steps(value: int) -> Callable[[Path, Path], None]:
    def tamper(folder: Path, tmp_path: Path) -> None:
        _edit_state(lambda p: p["trainer"].update(step=value))(folder, tmp_path)
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["step"] = value
        (folder / MANIFEST).write_text(json.dumps(manifest))

    return tamper


def _weights_only_list(folder: Path, tmp_path: Path) -> None:
    torch.save([torch.zeros(3)], folder / RNG_FILE)
    _rehash(folder, RNG_FILE)


def _pickle_as(name: str) -> Callable[[Path, Path], None]:
    def tamper(folder: Path, tmp_path: Path) -> None:
        with open(folder / name, "wb") as f:
            pickle.dump(_Payload(tmp_path / "payload_ran"), f)
        _rehash(folder, name)

    return tamper


def _pickle_in_callback_tensors(folder: Path, tmp_path: Path) -> None:
    torch.save({"Cb": {"adapter": _Payload(tmp_path / "payload_ran")}}, folder / CALLBACK_TENSORS)
    _rehash(folder, CALLBACK_TENSORS)


def _link_to_pagemap(name: str) -> Callable[[Path, Path], None]:
    def tamper(folder: Path, tmp_path: Path) -> None:
        (folder / name).unlink()
        (folder / name).symlink_to("/proc/self/pagemap")

    return tamper


TAMPERED = {
    "manifest step Infinity": (
        _edit_manifest(lambda t: t.replace('"step": 2', '"step": Infinity')),
        "'step' must be an integer >= 0",
    ),
    "step -5 in manifest and state": (_both_steps(-5), "'step' must be an integer >= 0"),
    "state step differs from the manifest's": (
        _edit_state(lambda p: p["trainer"].update(step=7)),
        "'step' 7 but the manifest says 2",
    ),
    "callbacks a list": (
        _edit_state(lambda p: p.update(callbacks=[1, 2])),
        "'callbacks': expected a mapping",
    ),
    "evals an int": (_edit_state(lambda p: p["trainer"].update(evals=3)), "'evals' must be a dict"),
    "metrics_rows -3": (
        _edit_state(lambda p: p["trainer"].update(metrics_rows=-3)),
        "'metrics_rows' must be an integer >= 0",
    ),
    "metrics_rows past the file": (
        _edit_state(lambda p: p["trainer"].update(metrics_rows=9)),
        "metrics.jsonl has 2 rows, the checkpoint counts 9",
    ),
    "metrics_rows that would cut the file": (
        _edit_state(lambda p: p["trainer"].update(metrics_rows=1)),
        "row 1 is step 0, the checkpoint's last step is 1",
    ),
    "a pending row of another step": (
        _edit_state(lambda p: p["trainer"].update(pending_row={"step": 0})),
        "'pending_row' must be null or the row of step 1",
    ),
    "schedule garbage": (_edit_state(lambda p: p["trainer"].update(schedule="dense")), "'schedule'"),
    "a weights-only list as the RNG file": (
        _weights_only_list,
        "expected {'rng': {'torch': a 1-d uint8 RNG state",
    ),
    "a pickle as the sharded checkpoint's metadata": (
        _pickle_as(METADATA),
        "holds more than checkpoint metadata",
    ),
    "a pickle as the sharded checkpoint's common state": (_pickle_as(COMMON), "unreadable"),
    "a pickle in callback_tensors.pt": (_pickle_in_callback_tensors, "refused, not tensors and plain data"),
    "manifest linked to /proc/self/pagemap": (_link_to_pagemap(MANIFEST), "is a symbolic link"),
    "trainer state linked to /proc/self/pagemap": (_link_to_pagemap(TRAINER_STATE), "is a symbolic link"),
}


@pytest.mark.parametrize("name", list(TAMPERED))
def test_a_tampered_checkpoint_is_passed_over_for_the_older_one(
    run: Path, name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tamper, reason = TAMPERED[name]
    newest = run / "checkpoints" / "step_00000002"
    tamper(newest, tmp_path)
    metrics_before = (run / "metrics.jsonl").read_bytes()
    start = time.monotonic()
    with single_rank_env(), caplog.at_level(logging.WARNING):
        policy = _policy()
        try:
            candidates = resume_candidates("auto", run / "checkpoints")
            loaded = load_run_checkpoint(candidates, policy, True, run / "metrics.jsonl")
        finally:
            policy.close()
    assert time.monotonic() - start < 120  # nothing read /proc/self/pagemap to its end (~256 GiB)
    assert loaded.path == run / "checkpoints" / "step_00000001", name
    assert TrainerState.from_dict(loaded.trainer).step == 1
    assert torch.equal(loaded.callbacks["Cb"]["adapter"]["x"], torch.full((2,), 1.0))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "step_00000002" in said and reason in said, said
    assert not (tmp_path / "payload_ran").exists()
    assert (run / "metrics.jsonl").read_bytes() == metrics_before


def test_without_an_untampered_one_it_is_one_error_naming_each(run: Path, tmp_path: Path) -> None:
    for step in (1, 2):
        _edit_state(lambda p: p["trainer"].update(metrics_rows=-3))(
            run / "checkpoints" / f"step_{step:08d}", tmp_path
        )
    with single_rank_env():
        policy = _policy()
        try:
            with pytest.raises(
                CheckpointError, match=r"no usable checkpoint: step_00000002 .*; step_00000001"
            ):
                load_run_checkpoint(
                    resume_candidates("auto", run / "checkpoints"), policy, True, run / "metrics.jsonl"
                )
        finally:
            policy.close()
