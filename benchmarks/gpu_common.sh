#!/usr/bin/env bash
# Shared set-up of the prepared GPU checks (gpu_check.sh, gpu_rollout_check.sh, gpu_speculative_check.sh);
# sourced, not run.
# The caller sets CHECK_NAME (log file prefix) and GPU_RESULTS (result file globs copied to $OUT after
# a GPU run), then sources this file with its own arguments. Defines MODE (gpu | tiny | dry), PY,
# RESULTS, LOG, log, step (a time-limited, logged command whose exit status and seconds also go to
# <check>_<mode>_stages.jsonl), log_header, import_stage and an EXIT trap that writes the summary and copies
# the outputs to $OUT; links pure-Python copies of pytest / pyyaml from the venv when the image lacks them.
# shellcheck disable=SC2034  # STATUS/FAILED/MODE/PY are read by the sourcing script

MODE=gpu
case "${1:-}" in
  "") ;;
  --tiny) MODE=tiny ;;
  --dry) MODE=dry ;;
  *) echo "usage: $0 [--tiny|--dry]" >&2; exit 2 ;;
esac

PY=${PYTHON:-python3}
if [ "$MODE" != gpu ]; then
  export TRITON_INTERPRET=1
  [ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
fi
export PYTHONPATH="kernels:.${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
RESULTS=${RESULTS_DIR:-benchmarks/results}
mkdir -p "$RESULTS"
LOG="$RESULTS/${CHECK_NAME}_${MODE}.log"
: > "$LOG"
log() { echo "$@" | tee -a "$LOG"; }
# Pure-Python fallbacks for pytest / pyyaml when the image lacks them (only those packages are linked; every
# check needs both: the rollout engine imports pyyaml). Carry those venv paths to the GPU machine.
SITE=.venv/lib/python3.11/site-packages
if ! "$PY" -c "import pytest, yaml" 2>/dev/null && [ -d "$SITE" ]; then
  SHIM=$(mktemp -d)
  for p in _pytest pytest pluggy iniconfig packaging yaml py.py; do
    [ -e "$SITE/$p" ] && ln -s "$PWD/$SITE/$p" "$SHIM/$p"
  done
  export PYTHONPATH="$PYTHONPATH:$SHIM"
  log "pytest/pyyaml not in the image: using the copies linked in $SHIM"
fi

STAGES="$RESULTS/${CHECK_NAME}_${MODE}_stages.jsonl"
: > "$STAGES"
step() { # step NAME TIMEOUT_S CMD...: run with a time limit, log output, record exit status and seconds
  local name=$1 limit=$2; shift 2
  log "=== $name (limit ${limit}s, $((SECONDS - CHECK_START))s into the check): $*"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  log "=== $name: exit $rc after $((SECONDS - start))s"
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"limit_s\": $limit}" >> "$STAGES"
  STATUS+=("$name=$rc")
  [ "$rc" -eq 0 ] || FAILED=1
}
# log_header TITLE: the check's first log lines (title, mode, date, commit; GPU, driver and library versions).
log_header() {
  log "=== $1, mode=$MODE, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee -a "$LOG"
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$LOG"
}
# import_stage LIMIT_S MODULE...: the "imports" stage, LIMIT_S on the GPU machine (120 s in the CPU rehearsals,
# which run on shared CI cores): import sparrow_kernels and the modules; fail when megatron or transformers come
# with them (the kernels and the rollout engine must run on the bare GPU image).
import_stage() {
  local limit=$1
  shift
  [ "$MODE" = gpu ] || limit=120
  step imports "$limit" "$PY" -c "
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformers'))
assert not bad, f'{sys.argv[1:]} must not import megatron/transformers, got {bad}'
print('imports ok; INTERPRETED =', sys.modules['sparrow_kernels'].INTERPRETED)
" sparrow_kernels "$@"
}
# shellcheck disable=SC2329  # called through the EXIT trap
finish() {
  log "=== summary: ${STATUS[*]:-none} (total $((SECONDS - CHECK_START))s)"
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" && cp "$RESULTS"/"${CHECK_NAME}_${MODE}"* "$OUT"/ 2>/dev/null
    if [ "$MODE" = gpu ]; then
      for pattern in "${GPU_RESULTS[@]}"; do
        # shellcheck disable=SC2086  # the pattern is a glob on purpose
        cp "$RESULTS"/$pattern "$OUT"/ 2>/dev/null
      done
    fi
  fi
  return 0
}
STATUS=()
FAILED=0
CHECK_START=$SECONDS
trap finish EXIT
