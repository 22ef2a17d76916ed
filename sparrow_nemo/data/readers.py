"""Rows of a prompt dataset on disk, read with bounds: JSONL (gzipped or not), Parquet, Arrow, folders of them.

What a path may be (:func:`dataset_files`):

- a file: ``.jsonl``, ``.jsonl.gz``, ``.parquet``, ``.arrow``;
- a folder saved by ``datasets.Dataset.save_to_disk`` (``state.json`` naming its ``.arrow`` files, Arrow IPC
  streams), read with pyarrow alone (``datasets`` is not needed at run time). A ``DatasetDict`` folder
  (``dataset_dict.json``) is refused with its splits named: give the split's folder (``<dir>/train``);
- any other folder, e.g. a local Hugging Face dataset (``huggingface-cli download --repo-type dataset ...
  --local-dir D``) or a folder of shards: every file of those suffixes below it (hidden folders skipped), in
  path order.

Bounds (each a one-line :class:`DataFileError` naming the file, or a bad row naming its number): a file must
be a regular file outside ``/proc``, ``/sys`` and ``/dev`` (a symlink is followed, then checked); at most
:data:`MAX_LINES` lines (blank ones included) and :data:`MAX_DECODED_BYTES` decoded bytes per file; a line
over :data:`MAX_ROW_BYTES` is a bad row, skipped unparsed. Parquet and Arrow files are read in batches of
:data:`BATCH_ROWS` rows, only the columns used: a first pass adds up what each batch decodes to (dictionary
columns measured without decoding them: a few MB of Parquet can hold a dictionary string repeated into
tens of GB) and refuses a file over :data:`MAX_LINES` rows, :data:`MAX_DECODED_BYTES` bytes or
:data:`BATCH_ROWS` x :data:`MAX_ROW_BYTES` bytes in one batch; then rows become Python objects one batch at a
time (never the whole table).
"""

from __future__ import annotations

import gzip
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", ".arrow")
#: a longer JSON line is a bad row, skipped without being parsed
MAX_ROW_BYTES = 32 << 20
#: lines (blank ones included) per JSONL file: a gzip of newlines would otherwise read for hours
MAX_LINES = 20_000_000
#: decoded bytes per file (JSONL text after gunzip; Arrow buffers of Parquet / Arrow batches)
MAX_DECODED_BYTES = 4 << 30
#: rows nested deeper (lists / objects in each other) are bad rows
MAX_ROW_DEPTH = 64
#: Parquet / Arrow rows decoded at a time
BATCH_ROWS = 256
#: folders whose files are never data (the kernel's pseudo-files read forever or block)
_PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


class DataFileError(ValueError):
    """A dataset path that cannot be read (missing, not a data file, over a bound, corrupt)."""


class RowProblem(ValueError):
    """Why one row cannot be used; the reader yields it in the row's place (it is not raised)."""


def _checked_file(path: Path) -> Path:
    """``path`` when it is a regular file outside the pseudo file systems (symlinks followed)."""
    try:
        real = path.resolve(strict=True)
        mode = os.stat(real).st_mode
    except (OSError, RuntimeError) as exc:  # missing, a symlink loop
        raise DataFileError(f"{path}: cannot open the data file ({exc})") from None
    if any(str(real) == root or str(real).startswith(root + "/") for root in _PSEUDO_ROOTS):
        raise DataFileError(f"{path}: resolves to {real}, a kernel pseudo-file, not a data file")
    if not stat.S_ISREG(mode):
        raise DataFileError(f"{path}: not a regular file (it resolves to {real})")
    return path


def _saved_dataset_files(folder: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder, in its ``state.json`` order."""
    state_file = _checked_file(folder / "state.json")
    try:
        state = json.loads(state_file.read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataFileError(f"{state_file}: not a datasets state.json ({exc})") from None
    if not names or not all(isinstance(n, str) and "/" not in n and n.endswith(".arrow") for n in names):
        raise DataFileError(f"{state_file}: '_data_files' must name .arrow files in the folder, got {names}")
    return [_checked_file(folder / n) for n in names]


def dataset_files(path: str | Path) -> list[Path]:
    """The data files of ``path`` (module docstring), checked; a :class:`DataFileError` when there are none."""
    path = Path(path)
    if not path.is_dir():
        if not path.name.lower().endswith(SUFFIXES):
            raise DataFileError(
                f"{path}: unsupported prompt file type; expected one of {', '.join(SUFFIXES)} or a folder"
            )
        if not path.exists() and not path.is_symlink():
            raise DataFileError(f"{path}: prompt file not found")
        return [_checked_file(path)]
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DataFileError(
            f"{path}: a DatasetDict folder; give one split's folder ({', '.join(splits) or 'none found'})"
        )
    if (path / "state.json").is_file():
        return _saved_dataset_files(path)
    found = sorted(
        p
        for p in path.rglob("*")
        if p.name.lower().endswith(SUFFIXES)
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not found:
        raise DataFileError(f"{path}: a folder without data files ({', '.join(SUFFIXES)}) below it")
    return [_checked_file(p) for p in found]


def read_rows(
    path: Path, columns: tuple[str, ...] | None = None, optional: tuple[str, ...] = ()
) -> Iterator[tuple[int, Any]]:
    """(1-based line or row number, the row's object or a :class:`RowProblem`) for each non-blank row of one data
    file; :class:`DataFileError` when the file is unreadable or over a bound.

    ``columns``: the top-level fields a Parquet / Arrow file must have; with those of ``optional`` it has, the
    only ones decoded (None: all). JSON lines are whole rows.
    """
    name = path.name.lower()
    try:
        if name.endswith((".parquet", ".arrow")):
            batches = _parquet_batches if name.endswith(".parquet") else _arrow_batches
            _check_decoded_size(path, batches(path, columns, optional))  # sizes only, no Python objects
            rows = _table_rows(batches(path, columns, optional))
        else:
            rows = _json_rows(path)
        for number, row in rows:
            too_deep = not isinstance(row, RowProblem) and _depth(row) > MAX_ROW_DEPTH
            yield number, RowProblem(f"row nested deeper than {MAX_ROW_DEPTH} levels") if too_deep else row
    except (OSError, EOFError) as exc:  # a corrupt or truncated gzip stream, an I/O error
        raise DataFileError(f"{path}: cannot read the file ({exc})") from None


def _json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    decoded = 0
    with opener(path, "rb") as fh:
        for i, raw in enumerate(_lines(fh), start=1):
            if i > MAX_LINES:
                raise DataFileError(f"{path}: more than {MAX_LINES:,} lines (blank ones included)")
            if raw is None:
                yield i, RowProblem(f"line longer than {MAX_ROW_BYTES} bytes")
                decoded += MAX_ROW_BYTES
                continue
            decoded += len(raw)
            if decoded > MAX_DECODED_BYTES:
                raise DataFileError(f"{path}:{i}: more than {MAX_DECODED_BYTES:,} bytes of text")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield i, RowProblem(f"invalid UTF-8 at byte {exc.start}")
                continue
            if line.strip():
                yield i, _parse_json(line)


def _parse_json(line: str) -> Any:
    """The line's JSON value, or a :class:`RowProblem` saying why not."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        return RowProblem(f"invalid JSON ({exc.msg} at column {exc.colno})")
    except RecursionError:
        return RowProblem(f"JSON nested deeper than the parser allows (rows may nest {MAX_ROW_DEPTH} levels)")
    except ValueError as exc:  # e.g. an integer of more digits than Python converts (sys.int_info)
        return RowProblem(f"invalid JSON value ({exc})")


def _lines(fh: Any) -> Iterator[bytes | None]:
    """The lines of a binary file, each read with a cap: a longer one is skipped to its end and is None."""
    while raw := fh.readline(MAX_ROW_BYTES + 1):
        if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
            while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield raw


def _selected(
    path: Path, names: list[str], columns: tuple[str, ...] | None, optional: tuple[str, ...]
) -> list[str] | None:
    """The columns to decode: ``columns`` (each must exist) and those of ``optional`` that exist."""
    if columns is None:
        return None
    for column in columns:
        if column not in names:
            raise DataFileError(f"{path}: no column '{column}' (columns: {', '.join(names) or 'none'})")
    return [*columns, *(c for c in optional if c in names and c not in columns)]


def _parquet_batches(path: Path, columns: tuple[str, ...] | None, optional: tuple[str, ...]) -> Iterator[Any]:
    import pyarrow as pa  # imported here: only Parquet / Arrow inputs need it
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        selected = _selected(path, file.schema_arrow.names, columns, optional)
        yield from file.iter_batches(batch_size=BATCH_ROWS, columns=selected)
    except pa.ArrowException as exc:
        raise DataFileError(f"{path}: not a readable Parquet file ({exc})") from None


def _arrow_batches(path: Path, columns: tuple[str, ...] | None, optional: tuple[str, ...]) -> Iterator[Any]:
    """Record batches of an Arrow IPC stream (``save_to_disk``) or IPC file, ``columns`` only."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
                schema = reader.schema
            except pa.ArrowInvalid:
                source.seek(0)
                file_reader = pa.ipc.open_file(source)
                batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
                schema = file_reader.schema
            selected = _selected(path, schema.names, columns, optional)
            for batch in batches:
                picked = batch.select(selected) if selected is not None else batch
                for start in range(0, picked.num_rows, BATCH_ROWS):
                    yield picked.slice(start, BATCH_ROWS)
    except pa.ArrowException as exc:
        raise DataFileError(f"{path}: not a readable Arrow file ({exc})") from None


def _decoded_size(batch: Any) -> int:
    """Bytes ``batch`` holds once its dictionary columns are decoded (computed without decoding them)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    size = 0
    for column in batch.columns:
        value_type = column.type.value_type if pa.types.is_dictionary(column.type) else None
        if value_type is not None and (
            pa.types.is_string(value_type)
            or pa.types.is_large_string(value_type)
            or pa.types.is_binary(value_type)
            or pa.types.is_large_binary(value_type)
        ):
            lengths = pc.binary_length(column.dictionary).take(column.indices)
            size += int(pc.sum(lengths).as_py() or 0) + 8 * len(column)
        else:
            size += column.get_total_buffer_size()
    return size


def _check_decoded_size(path: Path, batches: Iterator[Any]) -> None:
    """:class:`DataFileError` when the rows decode to more than the bounds (module docstring)."""
    rows, decoded = 0, 0
    for batch in batches:
        size = _decoded_size(batch)
        rows += batch.num_rows
        decoded += size
        if rows > MAX_LINES or size > BATCH_ROWS * MAX_ROW_BYTES or decoded > MAX_DECODED_BYTES:
            raise DataFileError(
                f"{path}: rows 1-{rows:,} decode to {decoded:,} bytes (at most {MAX_LINES:,} rows and "
                f"{MAX_DECODED_BYTES:,} bytes per file, {BATCH_ROWS * MAX_ROW_BYTES:,} per {BATCH_ROWS} rows)"
            )


def _table_rows(batches: Iterator[Any]) -> Iterator[tuple[int, Any]]:
    """Rows of record batches, one batch of Python objects at a time."""
    row = 0
    for batch in batches:
        for item in batch.to_pylist():
            row += 1
            yield row, item


def _depth(value: Any) -> int:
    """Nesting depth of lists/dicts in ``value`` (a scalar is 0), without recursion; stops past the bound."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_ROW_DEPTH:
                return deepest
            todo += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest
