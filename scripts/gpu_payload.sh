#!/usr/bin/env bash
# What the GPU scripts need on the device machine that its image lacks (issue 51), packed here and
# unpacked there. The image has torch, Triton, transformers, pandas, tqdm, pyyaml, numpy; not
# gguf (needed to read the GGUF target) nor FlashInfer (optional: gpu_check.py compares against it
# when installed; it is not carried). The GGUF target (98,362,432 bytes) is over the 64 MiB a
# device call carries, so it travels in pieces, one piece per call on the same warm machine (the
# ignored folder .gpu_payload/ stays there between calls), and is joined and checked there.
#
#   scripts/gpu_payload.sh pack     # here: .gpu_payload/{whl/gguf-*.whl, tok/*, piece.00,01}
#   scripts/gpu_payload.sh unpack   # there: wheels into /tmp/site (export PYTHONPATH=/tmp/site),
#                                   # the pieces joined into the pointer's cache folder, sha256 checked
# carry (one call each, on one warm machine): .gpu_payload/piece.00 (48 MiB) with the
# gpu_check.sh call, then .gpu_payload/piece.01 (45.8 MiB) + .gpu_payload/whl + .gpu_payload/tok
# with the call that unpacks and runs gpu_real_pair.py. Each call's whole tree must stay under
# 64 MiB: the tracked tree must be under ~14 MiB for this to fit (see /tmp/notes/issue-51.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
P=.gpu_payload
GGUF_VERSION=${GGUF_VERSION:-0.19.0}
CACHE=$("$PY" -c 'import json, os; print(os.path.expanduser(json.load(open(
  "data/models/smollm2-135m-instruct/gguf.json"))["cache_dir"]))')
SHA=$("$PY" -c 'import json; print(json.load(open(
  "data/models/smollm2-135m-instruct/gguf.json"))["sha256"])')
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  pack)
    grep -qxF "/$P/" .git/info/exclude 2>/dev/null || echo "/$P/" >> .git/info/exclude
    rm -rf "$P" && mkdir -p "$P/whl" "$P/tok"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$P/whl" "gguf==$GGUF_VERSION"
    cp "$CACHE"/tokenizer.json "$CACHE"/tokenizer_config.json "$CACHE"/chat_template.jinja "$P/tok/"
    split -b 48M -d "$CACHE/$NAME" "$P/piece."
    ls -l "$P" "$P/whl" ;;
  unpack)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$P"/whl/*.whl
    mkdir -p "$CACHE"
    cat "$P"/piece.* > "$CACHE/$NAME.part"
    echo "$SHA  $CACHE/$NAME.part" | sha256sum -c --quiet
    mv "$CACHE/$NAME.part" "$CACHE/$NAME"
    cp "$P"/tok/* "$CACHE/"
    echo "payload: $CACHE ready; run with PYTHONPATH=/tmp/site" ;;
  *) echo "usage: scripts/gpu_payload.sh pack|unpack" >&2; exit 2 ;;
esac
