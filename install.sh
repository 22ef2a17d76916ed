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
# The code reward runs model-written programs only under bubblewrap (README, "Security"): install it where
# it is missing and we may (root with apt); otherwise say so, and the code reward will refuse to run.
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get install -y -qq --no-install-recommends bubblewrap ||
      { apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap; }; } >/dev/null 2>&1 ||
      echo "note: 'apt-get install bubblewrap' failed: the code reward will refuse to run model code" >&2
  else
    echo "note: bubblewrap (bwrap) is not installed: the code reward will refuse to run model code" \
      "(install it with 'apt-get install bubblewrap' as root)" >&2
  fi
fi
echo "sparrow_nemo installed in .venv: run '.venv/bin/sparrow --help'"
