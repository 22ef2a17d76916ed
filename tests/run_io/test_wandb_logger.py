"""Weights & Biases logging, offline: the same metric names and values as metrics.jsonl; imported lazily.

The W&B run is real (``wandb`` in offline mode, no network); its offline record file is read back with a
small reader of W&B's record log (LevelDB log format: a 7-byte file header, 32 KiB blocks, each record
a 7-byte header ``crc32 u32, length u16, type u8`` then a protobuf ``wandb_internal_pb2.Record``; the
format of ``wandb/sdk/internal/datastore.py`` in wandb <= 0.18, kept by the Go core since).
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.run_io.metrics import MetricsWriter, read_metrics
from sparrow_nemo.run_io.wandb_logger import open_wandb

ROWS = [
    {"reward/mean": 0.25, "acceptance/p5/bin_1": 0.9, "sparsity/budget/bin_0": 16.0},
    {"reward/mean": 0.5, "acceptance/p5/bin_1": float("nan"), "train/loss": -0.125},
    {"reward/mean": 0.75, "sparsity/budget/bin_0": float("inf")},
]


def _records(run_file: Path) -> list:
    """The protobuf records of a W&B offline run file."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = run_file.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(raw):
            break  # the end, or a record W&B's core process is still writing
        fragment = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # FULL
            records.append(fragment)
        elif kind == 2:  # FIRST
            pending = fragment
        elif kind == 3:  # MIDDLE
            pending += fragment
        else:  # LAST
            records.append(pending + fragment)
    parsed = []
    for data in records:
        record = pb.Record()
        record.ParseFromString(data)
        parsed.append(record)
    return parsed


def _history(run_file: Path, timeout_s: float = 180.0) -> list[dict[str, float]]:
    """The ``history`` rows of a finished W&B offline run (W&B's own ``_step`` etc. left out).

    W&B's core process writes the file after ``finish()`` returns: wait for its exit record.
    """
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s
    records: list = []
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"{run_file}: no complete exit record after {timeout_s:g} s"
        try:
            records = _records(run_file)
        except DecodeError:  # read while a record was half written: read again
            records = []
        if not any(r.WhichOneof("record_type") == "exit" for r in records):
            time.sleep(0.5)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            rows.append({k: v for k, v in items.items() if not k.startswith("_")} | {"step": items["_step"]})
    return rows


def test_offline_wandb_gets_the_jsonl_rows_under_the_same_names(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = load_config("tiny_cpu_short", ["logging.wandb.enabled=true", "logging.wandb.tags=[test]"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    writer = MetricsWriter(
        run_dir, jsonl=True, wandb=open_wandb(config.logging.wandb, run_dir, config.to_dict())
    )
    for step, row in enumerate(ROWS):
        writer.write(step, row)
    writer.close()
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged = _history(run_file)
    expected = [
        {"step": row["step"]} | {k: v for k, v in row.items() if k not in ("step", "time") and v is not None}
        for row in read_metrics(run_dir / "metrics.jsonl")
    ]
    assert logged == expected  # same names, same finite values, same steps; non-finite left out
    assert not any(math.isnan(v) for r in logged for v in r.values())


def test_wandb_is_not_imported_unless_enabled(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from sparrow_nemo.grpo.recipe import load_config\n"
        "from sparrow_nemo.run_io.metrics import MetricsWriter\n"
        "from sparrow_nemo.run_io.wandb_logger import open_wandb\n"
        "from pathlib import Path\n"
        "c = load_config('tiny_cpu_short')\n"
        f"MetricsWriter(Path({str(tmp_path)!r}), wandb=open_wandb(c.logging.wandb, Path({str(tmp_path)!r}), {{}}))\n"
        "assert 'wandb' not in sys.modules, 'wandb imported with logging.wandb.enabled=false'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_enabled_without_the_package_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    config = load_config("tiny_cpu_short", ["logging.wandb.enabled=true"])
    with pytest.raises(RuntimeError, match=r"needs the wandb package: pip install 'sparrow_nemo\[wandb\]'"):
        open_wandb(config.logging.wandb, tmp_path, {})
