#!/usr/bin/env bash
# One prepared check of sparrow_kernels on a GPU machine, sized for ONE device call of under 6 minutes on
# an H200 with a cold Triton cache (stage limits sum to 340 s; run it with a call timeout of ~420 s):
#   1. imports (20 s): the kernels and their test reference import neither megatron nor transformers;
#   2. tests (150 s): tests/kernels natively on the GPU (incl. a CUDA-graph capture of a decode layer); about
#      55 JIT specialisations (~1-1.5 s of compile each) with a cold Triton cache;
#   3. compile (70 s): every kernel variant of the issue's target rows and of the launch-knob sweep (about
#      25) is run once (Triton JIT-compiles on first use); compile seconds go to sparse_attention_warmup.jsonl;
#   4. benchmark (100 s): the target rows (8B, batch 64, 32K/4K, 10%/25%, with the verify case and the
#      sweep on 32K/10%) first, then the Qwen3 1.7B/8B/14B x batch 64/256 x 4K/16K/32K grid while the
#      65-s row budget lasts. Each row and its PASS/FAIL lines are written the moment it finishes.
# Output: benchmarks/results/ (or $RESULTS_DIR): gpu_check_<mode>.log, gpu_check_<mode>_stages.jsonl (exit
# status and seconds per stage), gpu_check_<mode>_tests.xml, sparse_attention_warmup.jsonl,
# sparse_attention.jsonl; everything is also copied to $OUT when set.
#
# Usage:  bash benchmarks/gpu_check.sh          # GPU (the image's python; no install, PYTHONPATH only)
#         bash benchmarks/gpu_check.sh --tiny   # CPU, TRITON_INTERPRET=1: all kernel tests + the tiny stages
#         bash benchmarks/gpu_check.sh --dry    # CPU: collect the tests + the tiny compile/benchmark stages (CI)
# The GPU image needs torch, triton, numpy, pytest and pyyaml. Where pytest/pyyaml are missing, pure-Python
# copies under .venv/lib/python3.11/site-packages/{_pytest,pytest,pluggy,iniconfig,packaging,yaml} are used
# (carry those paths to the GPU machine).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

CHECK_NAME=gpu_check
GPU_RESULTS=("sparse_attention*.jsonl")
# shellcheck source=benchmarks/gpu_common.sh
source benchmarks/gpu_common.sh "$@"

log_header "sparrow_kernels check"
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
log "triton cache $TRITON_CACHE: $(find "$TRITON_CACHE" -name '*.cubin' 2>/dev/null | wc -l) compiled kernels at start"
import_stage 20 sparrow_kernels.decode sparrow_kernels.verify sparrow_nemo.sparse.attention

PYTEST=("$PY" -m pytest -q -p no:cacheprovider tests/kernels --junitxml "$RESULTS/gpu_check_${MODE}_tests.xml")
BENCH=("$PY" benchmarks/sparse_attention.py)
case "$MODE" in
  gpu)
    step tests 150 "${PYTEST[@]}"
    step compile 70 "${BENCH[@]}" --only-targets --sweep --warmup-only --out "$RESULTS/sparse_attention_warmup.jsonl"
    step benchmark 100 "${BENCH[@]}" --sweep --reps 30 --time-budget-s 65 --out "$RESULTS/sparse_attention.jsonl"
    ;;
  tiny)
    step tests 900 "${PYTEST[@]}"
    step compile 300 "${BENCH[@]}" --tiny --device cpu --sweep --warmup-only --out "$RESULTS/gpu_check_tiny_warmup.jsonl"
    step benchmark 300 "${BENCH[@]}" --tiny --device cpu --sweep --reps 1 --out "$RESULTS/gpu_check_tiny_bench.jsonl"
    ;;
  dry)
    step tests 120 "${PYTEST[@]}" --collect-only
    step compile 300 "${BENCH[@]}" --tiny --device cpu --sweep --warmup-only --out "$RESULTS/gpu_check_dry_warmup.jsonl"
    step benchmark 300 "${BENCH[@]}" --tiny --device cpu --sweep --reps 1 --out "$RESULTS/gpu_check_dry_bench.jsonl"
    ;;
esac
exit "$FAILED"
