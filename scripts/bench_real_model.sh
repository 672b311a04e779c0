#!/usr/bin/env bash
# The speed benchmarks of issue 38 item 4 on the real pair (SmolLM2-135M-Instruct and its EAGLE-3
# head), one after the other, niced, on chat-templated held-out prompts:
#   spec       EAGLE-3 arms vs the engine's own baseline, bs=1, with the per-step ceiling,
#              the overhead and where it sits (workbench.bench.step_cost)
#   peers      transformers generate / prompt lookup (/ assisted when an assistant with the
#              target's tokenizer exists) vs the workbench baseline and EAGLE-3, bs=1
#   policies   closed-loop concurrency sweep with every named policy (baseline, never, always,
#              threshold:auto, goodput, sglang, vllm), arms interleaved
#   concurrency, threshold, k0, load, shapes: the other sweeps (ONLY= picks the steps)
# Every result JSON (under $OUT) carries machine, load before/after, command and commit, as every
# `bench` result does; $OUT/bench_real_model.jsonl adds per step the exact command, `uptime`
# before and after, seconds, exit code, commit and the head's checksum.
#
# Usage (defaults in brackets; every figure measured on a busy machine is provisional):
#   MODEL=[data/models/smollm2-135m-instruct] DRAFT=[data/models/smollm2-eagle3] \
#   SRC=[data/prompts/real/heldout.jsonl] OUT=[data/results/smollm2-135m-instruct] \
#   PROMPTS=[4] NEW=[32] REPEATS=[2] LEVELS=[1,2,4] SWEEP_PROMPTS=[4] SWEEP_NEW=[16] \
#   ENGINE=[threads=1,gemm=onednn] ENGINE_B=[] SWEEP_MODE=[--sequential] \
#   ONLY="[spec peers policies]" \
#   scripts/bench_real_model.sh
# The defaults are sized for a busy 2-core machine (about 15 min in all); on a quiet one raise
# them (e.g. PROMPTS=8 NEW=64 REPEATS=3 LEVELS=1,2,4,8,16 SWEEP_MODE= ONLY="spec peers
# policies concurrency threshold k0 load shapes"). `peers` runs with --quick: no compiled
# transformers peer (its compile takes minutes per prompt length on a small CPU) and at most
# 32 new tokens.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-data/models/smollm2-135m-instruct}
DRAFT=${DRAFT-data/models/smollm2-eagle3}   # empty: no head (baseline arms only)
SRC=${SRC:-data/prompts/real/heldout.jsonl}
OUT=${OUT:-data/results/smollm2-135m-instruct}
PROMPTS=${PROMPTS:-4}          # bs=1 benches: rendered prompts, categories interleaved
NEW=${NEW:-32}                 # bs=1 benches: new tokens per prompt
REPEATS=${REPEATS:-2}          # every measurement this many times: 95 % intervals
LEVELS=${LEVELS:-1,2,4}        # concurrency levels of the sweeps
SWEEP_PROMPTS=${SWEEP_PROMPTS:-4}
SWEEP_NEW=${SWEEP_NEW:-16}
# forced engine choices: every engine of a sweep skips the thread/GEMM measurement (choices
# measured on a busy machine are not cached, so each engine would re-measure for ~30 s); one
# thread is what autotune picks on this 2-core machine beside other work. The transformers
# peers run in the same process with the same torch thread count.
ENGINE=${ENGINE-threads=1,gemm=onednn}   # empty: the engine's measured "auto" choices
# peers: a second engine, ENGINE plus these overrides, in the same turns (arms "... [B]"), e.g.
# ENGINE_B=row_floor=1,draft_dtype=same: the measured row floor and draft dtype side by side
ENGINE_B=${ENGINE_B-}
# sweeps: one engine, the arms of a cell back to back (order rotated per repeat); empty for one
# engine per arm, interleaved step by step (each engine loads the GGUF: ~1 min on a busy machine)
SWEEP_MODE=${SWEEP_MODE---sequential}
ONLY=${ONLY:-spec peers policies}
PY=${PY:-.venv/bin/python}
NICE=${NICE:-nice -n 10}

mkdir -p "$OUT"
LOG="$OUT/bench_real_model.jsonl"
WORK="$OUT/prompts"
mkdir -p "$WORK"

# the chat-templated prompts the benches read (--prompts-file), each file rendered only when a
# step of ONLY reads it (a result already in $OUT keeps the prompts it ran on)
case " $ONLY " in *" spec "*|*" peers "*)
  $PY -m workbench.bench.real_model --model "$MODEL" --src "$SRC" --out "$WORK/bs1.jsonl" \
      --limit "$PROMPTS" ;;
esac
case " $ONLY " in *" policies "*|*" concurrency "*|*" threshold "*|*" k0 "*|*" load "*|*" shapes "*)
  $PY -m workbench.bench.real_model --model "$MODEL" --src "$SRC" --out "$WORK/sweep.jsonl" \
      --limit "$SWEEP_PROMPTS" ;;
esac

step() {  # step NAME ARGS...: run `python -m workbench bench ARGS...` niced, log it
    local name=$1; shift
    local before after t0 t1 rc
    before=$(uptime)
    t0=$(date +%s)
    echo "== $name: python -m workbench bench $*  ($before)"
    set +e
    $NICE $PY -m workbench bench "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    t1=$(date +%s)
    after=$(uptime)
    $PY - "$LOG" "$name" "$rc" "$((t1 - t0))" "$before" "$after" "$DRAFT" "$*" <<'PY'
import hashlib, json, subprocess, sys, time
from pathlib import Path
log, name, rc, secs, before, after, draft, args = sys.argv[1:]
head = Path(draft) / "model.safetensors"
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                       capture_output=True, text=True).stdout
row = {"step": name, "command": f"python -m workbench bench {args}", "exit": int(rc),
       "seconds": int(secs), "uptime_before": before.strip(), "uptime_after": after.strip(),
       "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit.strip(),
       "tree_dirty": bool(dirty.strip()), "draft": draft,
       "draft_sha256": hashlib.sha256(head.read_bytes()).hexdigest() if head.is_file() else None}
with open(log, "a") as f:
    f.write(json.dumps(row) + "\n")
PY
    echo "== $name: exit $rc, $((t1 - t0)) s ($after)"
}

COMMON=(--model "$MODEL" --draft "$DRAFT" --engine "$ENGINE" --out "$OUT")
SWEEP=(--prompts-file "$WORK/sweep.jsonl" --max-new-tokens "$SWEEP_NEW" --levels "$LEVELS")
if [ -n "$SWEEP_MODE" ]; then SWEEP+=("$SWEEP_MODE"); fi
for s in $ONLY; do
  case $s in
    spec)        step spec spec "${COMMON[@]}" --prompts-file "$WORK/bs1.jsonl" \
                   --max-new-tokens "$NEW" --repeats "$REPEATS" ;;
    peers)       step peers peers "${COMMON[@]}" --prompts-file "$WORK/bs1.jsonl" \
                   --max-new-tokens "$NEW" --repeats "$REPEATS" --quick \
                   ${ENGINE_B:+--engine-b "$ENGINE_B"} ;;
    policies)    step policies concurrency "${COMMON[@]}" "${SWEEP[@]}" \
                   --policy always,threshold:auto,goodput,sglang,vllm ;;
    concurrency) step concurrency concurrency "${COMMON[@]}" "${SWEEP[@]}" ;;
    threshold)   step threshold threshold "${COMMON[@]}" "${SWEEP[@]}" ;;
    k0)          step k0 k0 "${COMMON[@]}" "${SWEEP[@]}" ;;
    load)        step load load "${COMMON[@]}" --prompts-file "$WORK/sweep.jsonl" \
                   --max-new-tokens "$SWEEP_NEW" --repeats "$REPEATS" ;;
    shapes)      step shapes shapes "${COMMON[@]}" --prompts-file "$WORK/sweep.jsonl" \
                   --max-new-tokens "$SWEEP_NEW" --tau 3 ;;
    *) echo "ONLY: unknown step $s (spec peers policies concurrency threshold k0 load shapes)" >&2
       exit 2 ;;
  esac
done
echo "results: $OUT (steps: $LOG)"
