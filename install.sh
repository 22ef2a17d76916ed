#!/usr/bin/env bash
# Set up sparrow_nemo in ./.venv on a CPU machine (Python 3.11).
# The pinned CPU torch wheel goes in first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "sparrow_nemo installed in .venv: run '.venv/bin/sparrow --help'"
