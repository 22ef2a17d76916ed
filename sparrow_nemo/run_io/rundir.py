"""The run folder: the resolved config and its hash, and the check that a resumed folder is this recipe's."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any, Protocol

import yaml

from sparrow_nemo.config import ConfigError
from sparrow_nemo.config.compose import dotted_leaves

logger = logging.getLogger(__name__)

HASH_FILE = "config_hash.txt"
#: key differences listed in the refusal message at most
_MAX_DIFFS = 8


class Recipe(Protocol):
    """What the run folder reads of a recipe (:class:`~sparrow_nemo.grpo.recipe.Recipe`)."""

    name: str
    logging: Any  #: ``run_dir``
    checkpoint: Any  #: ``resume``, ``force_resume``

    def hash(self) -> str: ...

    def to_yaml(self) -> str: ...

    def hashed_dict(self) -> dict[str, Any]: ...


def make_run_dir(config: Recipe, run_dir: str | Path | None = None) -> Path:
    """Create the run folder and write ``config.yaml`` (the resolved recipe) and ``config_hash.txt``.

    ``run_dir`` given: used as is. Otherwise ``<logging.run_dir or runs>/<name>-<UTC timestamp>``.
    """
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        run_dir = Path(config.logging.run_dir or "runs") / f"{config.name}-{stamp}"
    path = Path(run_dir)
    check_folder(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.yaml").write_text(
            f"# sparrow config '{config.name}', hash {config.hash()}\n{config.to_yaml()}"
        )
        (path / HASH_FILE).write_text(config.hash() + "\n")
    except OSError as exc:  # read-only or full file system, no permission
        raise ValueError(f"run folder {path}: cannot write {exc.filename or path}: {exc.strerror}") from None
    return path


def check_folder(run_dir: str | Path) -> None:
    """Refuse a run folder path that names an existing non-folder (a file, a dangling link) or that cannot
    be looked up (a symlink loop, a file as a parent folder, no permission); a missing one is fine.

    Raises:
        ValueError: one line naming the path and what it is.
    """
    path = Path(run_dir)
    for part in (path, *path.parents):  # the path, else its nearest existing parent
        what = "the run folder" if part == path else f"its parent {part}"
        try:
            mode = os.stat(part).st_mode
        except FileNotFoundError:
            if os.path.lexists(part):
                raise ValueError(f"run folder {path}: {what} is a symbolic link to nothing") from None
            continue
        except OSError as exc:
            why = "a symbolic link loop" if exc.errno == errno.ELOOP else exc.strerror
            raise ValueError(f"run folder {path} cannot be used: {why}") from None
        if not stat.S_ISDIR(mode):
            raise ValueError(f"run folder {path}: {what} exists and is not a folder")
        return


def _key_differences(run_dir: Path, config: Recipe) -> list[str]:
    """``key: folder value -> this value`` for the hashed keys that differ from the folder's config.yaml."""
    try:
        old = dotted_leaves(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError):
        return []
    new = dotted_leaves(config.hashed_dict())
    return [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in sorted(new.items()) if old.get(k, v) != v]


def check_run_dir(config: Recipe, run_dir: str | Path) -> None:
    """Refuse to continue in a run folder made by a different recipe (its ``config_hash.txt`` differs).

    Passes for a new or empty folder, for ``checkpoint.resume=never`` and with ``checkpoint.force_resume``
    (then with a warning). Reads only, so it can run on every rank before anything is written.

    Raises:
        ConfigError: naming the folder, both hashes, the differing keys (up to a few) and the way out.
        ValueError: ``run_dir`` is not a usable folder path (:func:`check_folder`).
    """
    check_folder(run_dir)
    path = Path(run_dir) / HASH_FILE
    if not path.is_file() or config.checkpoint.resume == "never":
        return
    old, new = path.read_text().strip(), config.hash()
    if old == new:
        return
    diffs = _key_differences(Path(run_dir), config)
    shown = "; ".join(diffs[:_MAX_DIFFS]) + (
        f"; ... {len(diffs) - _MAX_DIFFS} more" if len(diffs) > _MAX_DIFFS else ""
    )
    what = f"run folder {run_dir} belongs to config hash {old}, this recipe's is {new}" + (
        f" ({shown})" if shown else ""
    )
    if config.checkpoint.force_resume:
        logger.warning("%s: resuming anyway (checkpoint.force_resume=true)", what)
        return
    raise ConfigError(
        f"{what}; refusing to resume into it: use another --run-dir, checkpoint.resume=never, or "
        "checkpoint.force_resume=true"
    )
