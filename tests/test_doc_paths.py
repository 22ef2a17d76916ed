"""Every repository path the README and the docs name in backticks exists.

A token counts as a repository path when it has a ``/`` and starts at a top-level folder of the repository
(``benchmarks/...``) or at a package of ``sparrow_nemo`` (``grpo/losses.py``, as the docs abbreviate them);
placeholders (``<run>``, ``*``, ``...``) are not checked, nor the weights and data folders a user downloads
(``data/dapo-math-17k``). Output files of a run (``metrics.jsonl``) and other projects' sources
(``tensorrt_llm/...``) are not repository paths.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))} - {"runs", "data"}
PACKAGES = {p.name for p in (REPO / "sparrow_nemo").iterdir() if p.is_dir() and not p.name.startswith("__")}
TOKEN = re.compile(r"`([\w.\-/]+/[\w.\-/]*)`")
#: folders a user makes at the repository root (the recipes read weights and data there)
USER_MADE = ("data/", "checkpoints/")


def repository_paths(doc: Path) -> list[tuple[int, str]]:
    """(line number, path) of each backticked token of ``doc`` that names a repository path."""
    found = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for token in TOKEN.findall(line):
            user_made = token.startswith(USER_MADE) and not token.endswith(".py")
            if token.split("/")[0] in TOP | PACKAGES and "..." not in token and not user_made:
                found.append((number, token))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_named_paths_exist(doc: Path) -> None:
    missing = [
        f"{doc.relative_to(REPO)}:{number}: `{token}`"
        for number, token in repository_paths(doc)
        if not any((base / token).exists() for base in (REPO, doc.parent, REPO / "sparrow_nemo"))
    ]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_scan_sees_paths() -> None:
    tokens = [token for _, token in repository_paths(REPO / "README.md")]
    assert any(t.startswith("recipes/") for t in tokens) and any(t.startswith("slurm/") for t in tokens)
