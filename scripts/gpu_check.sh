#!/usr/bin/env bash
# One GPU check for a single H200, under 8 minutes in all:
#   1. the kernel tests on CUDA (real Triton kernels, FlashInfer comparison when installed),
#   2. every other test marked `gpu`,
#   3. benchmarks (scripts/gpu_check.py): Triton tree_attention vs the torch reference vs
#      FlashInfer custom-mask prefill, an 8B-shaped decode HBM-bandwidth microbenchmark, and the
#      engine's decode step (attention backends eager vs CUDA graphs vs overlapped host prep).
# Writes one JSON summary gpu_check.json, with the pytest logs and JUnit files beside it, under
# <root>/gpu/<device>/ where <root> is $OUT when set (the device machine's return folder; copy
# $OUT/gpu/<device>/ to data/results/gpu/<device>/ and commit it), else data/results, and
# <device> is the device's name as a slug (e.g. nvidia-h100-80gb-hbm3; "cpu-smoke" for --smoke
# on a machine without CUDA). Exit status: 0 only if every step passed.
#
# Usage: scripts/gpu_check.sh [--smoke]
#   --smoke  on any machine (CPU included): the kernel tests of one small file and the gpu-marked
#            tests (which skip without CUDA) in the Triton interpreter, and gpu_check.py --smoke
#            (tiny shapes). It checks the script; it measures nothing.
# Environment: PYTHON (default .venv/bin/python, else python3); without --smoke torch with CUDA
# must be importable. GPU_CHECK_TOTAL_S (default 440, under 8 minutes with the kill margins):
# the whole run's seconds, split 240:120:rest between the kernel tests, the gpu-marked tests and
# the benchmarks (a 15-minute device lease that also runs gpu_real_pair.py wants ~300).
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
TOTAL=${GPU_CHECK_TOTAL_S:-440}
if ! [[ $TOTAL =~ ^[0-9]+$ ]] || (( TOTAL < 120 )); then
  echo "gpu_check: GPU_CHECK_TOTAL_S must be an integer >= 120, got '$TOTAL'" >&2
  exit 2
fi
for arg in "$@"; do
  case $arg in
    --smoke) SMOKE=1 ;;
    *) echo "gpu_check: unknown argument $arg (usage: scripts/gpu_check.sh [--smoke])" >&2
       exit 2 ;;
  esac
done

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
# Real kernels on the GPU: no interpreter, default dispatch. TRITON_INTERPRET=0 rather than
# unset: tests/conftest.py does setdefault("TRITON_INTERPRET", "1") for CPU runs, which would
# otherwise make every Triton test on the GPU run (and pass) in the interpreter. The smoke run
# on a CPU keeps the interpreter (there is no other way to run a Triton kernel there).
unset WORKBENCH_KERNELS
if [[ $SMOKE -eq 1 ]]; then export TRITON_INTERPRET=1; else export TRITON_INTERPRET=0; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)

HAVE_CUDA=0
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  HAVE_CUDA=1
elif [[ $SMOKE -eq 0 ]]; then
  echo "gpu_check: torch sees no CUDA device (python: $PY); --smoke runs on a CPU" >&2
  exit 2
fi
# the device's name as a folder name: "NVIDIA H100 80GB HBM3" -> nvidia-h100-80gb-hbm3
DEVICE=$("$PY" scripts/gpu_device.py)
if [[ $SMOKE -eq 1 ]]; then DEVICE="$DEVICE-smoke"; fi
OUT_DIR="${OUT:-data/results}/gpu/$DEVICE"
mkdir -p "$OUT_DIR"
echo "gpu_check: device $DEVICE (cuda: $HAVE_CUDA), results in $OUT_DIR"

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
if [[ $SMOKE -eq 1 ]]; then
  run_pytest kernels 120 tests/kernels/test_kernels_greedy_accept.py
  run_pytest gpu_marked 120 -m gpu tests --ignore=tests/kernels
  BUDGET=60
  SMOKE_ARGS=(--smoke)
else
  run_pytest kernels $(( TOTAL * 240 / 440 )) tests/kernels
  run_pytest gpu_marked $(( TOTAL * 120 / 440 )) -m gpu tests --ignore=tests/kernels
  ELAPSED=$(( $(date +%s) - START ))
  BUDGET=$(( TOTAL - ELAPSED ))  # leave the whole run under TOTAL (+ the kill margins)
  if (( BUDGET < 30 )); then BUDGET=30; fi
  SMOKE_ARGS=()
fi
echo "== benchmarks (budget ${BUDGET}s, $(( $(date +%s) - START ))s used)"
timeout -k 10 $(( BUDGET + 20 )) "$PY" scripts/gpu_check.py --out "$OUT_DIR/gpu_check.json" \
  --budget-s "$BUDGET" "${SMOKE_ARGS[@]}" "${JUNIT_ARGS[@]}"
BENCH_RC=$?
if [[ $BENCH_RC -ne 0 ]]; then FAILED=1; fi

echo "gpu_check: done in $(( $(date +%s) - START ))s, summary $OUT_DIR/gpu_check.json"
exit "$FAILED"
