#!/usr/bin/env bash
# One prepared check of sparrow_kernels on a GPU machine (target: one H200, under 5 minutes):
#   1. import hygiene: the kernels and their test reference import neither megatron nor transformers;
#   2. the kernel correctness tests (tests/kernels), natively on the GPU;
#   3. the benchmark grid (Qwen3 1.7B/8B/14B attention shapes x batch 64/256 x 4K/16K/32K x 10%/25%);
#   4. a launch-knob sweep of the attention kernel on the 8B, batch 64, 32K configurations.
# Output: benchmarks/results/ (or $RESULTS_DIR): gpu_check_<mode>.log, gpu_check_<mode>_tests.xml,
# sparse_attention.jsonl, sparse_attention_sweep.jsonl; everything is also copied to $OUT when set.
#
# Usage:  bash benchmarks/gpu_check.sh          # GPU (the image's python; no install, PYTHONPATH only)
#         bash benchmarks/gpu_check.sh --tiny   # CPU, TRITON_INTERPRET=1: all tests + tiny benchmark
#         bash benchmarks/gpu_check.sh --dry    # CPU: like --tiny but only collects the tests (fast)
# The GPU image needs torch, triton, numpy, pytest and pyyaml. Where pytest/pyyaml are missing, pure-Python
# copies under .venv/lib/python3.11/site-packages/{_pytest,pytest,pluggy,iniconfig,packaging,yaml} are used
# (carry those paths to the GPU machine).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

CHECK_NAME=gpu_check
GPU_RESULTS=("sparse_attention*.jsonl")
# shellcheck source=benchmarks/gpu_common.sh
source benchmarks/gpu_common.sh "$@"

# Pure-Python fallbacks for pytest / pyyaml when the image lacks them (only those packages are linked).
SITE=.venv/lib/python3.11/site-packages
if ! "$PY" -c "import pytest, yaml" 2>/dev/null && [ -d "$SITE" ]; then
  SHIM=$(mktemp -d)
  for p in _pytest pytest pluggy iniconfig packaging yaml py.py; do
    [ -e "$SITE/$p" ] && ln -s "$PWD/$SITE/$p" "$SHIM/$p"
  done
  export PYTHONPATH="$PYTHONPATH:$SHIM"
  log "pytest/pyyaml not in the image: using the copies linked in $SHIM"
fi

log "=== sparrow_kernels check, mode=$MODE, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$LOG"
"$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$LOG"

step imports 30 "$PY" -c "
import sys
import sparrow_kernels, sparrow_kernels.decode, sparrow_nemo.sparse.attention
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'transformers'))
assert not bad, f'kernel tests must not import megatron/transformers, got {bad}'
print('imports ok; INTERPRETED =', sparrow_kernels.INTERPRETED)
"

PYTEST=("$PY" -m pytest -q -p no:cacheprovider tests/kernels --junitxml "$RESULTS/gpu_check_${MODE}_tests.xml")
BENCH=("$PY" benchmarks/sparse_attention.py)
case "$MODE" in
  gpu)
    step tests 100 "${PYTEST[@]}"
    step benchmark 120 "${BENCH[@]}" --out "$RESULTS/sparse_attention.jsonl" --reps 40
    step sweep 45 "${BENCH[@]}" --models qwen3-8b --batches 64 --lengths 32768 --fractions 0.1 --sweep --reps 25 \
      --out "$RESULTS/sparse_attention_sweep.jsonl"
    ;;
  tiny)
    step tests 600 "${PYTEST[@]}"
    step benchmark 300 "${BENCH[@]}" --tiny --device cpu --reps 1 --out "$RESULTS/gpu_check_tiny_bench.jsonl"
    ;;
  dry)
    step tests 120 "${PYTEST[@]}" --collect-only
    step benchmark 300 "${BENCH[@]}" --tiny --device cpu --reps 1 --out "$RESULTS/gpu_check_dry_bench.jsonl"
    ;;
esac
exit "$FAILED"
