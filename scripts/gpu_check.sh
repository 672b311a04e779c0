#!/usr/bin/env bash
# One GPU check for a single H200, under 8 minutes in all:
#   1. the kernel tests on CUDA (real Triton kernels, FlashInfer comparison when installed),
#   2. every other test marked `gpu`,
#   3. benchmarks (scripts/gpu_check.py): Triton tree_attention vs the torch reference vs
#      FlashInfer custom-mask prefill, an 8B-shaped decode HBM-bandwidth microbenchmark, and the
#      engine's decode step (attention backends eager vs CUDA graphs vs overlapped host prep).
# Writes one JSON summary to $OUT/gpu_check.json when $OUT is set, else data/results/gpu_check.json
# (pytest logs and JUnit files beside it). Exit status: 0 only if every step passed.
#
# Environment: PYTHON (default .venv/bin/python, else python3); torch with CUDA must be importable.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT_DIR="${OUT:-data/results}"
mkdir -p "$OUT_DIR"
# Real kernels on the GPU: no interpreter, default dispatch. TRITON_INTERPRET=0 rather than
# unset: tests/conftest.py does setdefault("TRITON_INTERPRET", "1") for CPU runs, which would
# otherwise make every Triton test on the GPU run (and pass) in the interpreter.
unset WORKBENCH_KERNELS
export TRITON_INTERPRET=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device (python: $PY)" >&2
  exit 2
fi
"$PY" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)'

run_pytest() {  # name, timeout_s, pytest args...
  local name=$1 limit=$2
  shift 2
  echo "== pytest $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" \
    --junitxml="$OUT_DIR/gpu_check_$name.xml" "$@" >"$OUT_DIR/gpu_check_$name.log" 2>&1
  local rc=$?
  tail -n 15 "$OUT_DIR/gpu_check_$name.log"
  # 5 = nothing collected (no gpu-marked tests there): not a failure.
  if [[ $rc -eq 5 ]]; then rc=0; fi
  JUNIT_ARGS+=(--junit "$name=$OUT_DIR/gpu_check_$name.xml:$rc")
  if [[ $rc -ne 0 ]]; then FAILED=1; fi
}

JUNIT_ARGS=()
FAILED=0
run_pytest kernels 240 tests/kernels
run_pytest gpu_marked 120 -m gpu tests --ignore=tests/kernels

ELAPSED=$(( $(date +%s) - START ))
BUDGET=$(( 440 - ELAPSED ))  # leave the whole run under 8 minutes
if (( BUDGET < 30 )); then BUDGET=30; fi
echo "== benchmarks (budget ${BUDGET}s, ${ELAPSED}s used)"
timeout -k 10 $(( BUDGET + 20 )) "$PY" scripts/gpu_check.py --out "$OUT_DIR/gpu_check.json" \
  --budget-s "$BUDGET" "${JUNIT_ARGS[@]}"
BENCH_RC=$?
if [[ $BENCH_RC -ne 0 ]]; then FAILED=1; fi

echo "gpu_check: done in $(( $(date +%s) - START ))s, summary $OUT_DIR/gpu_check.json"
exit "$FAILED"
