#!/usr/bin/env bash
# One device call (carrying .whl and .gpu_commit): the real-ShareGPT run's tail. In the fp8 run
# 1,058 of the 1,317 decode passes of 1-64 sequences hold 16 or fewer (3.8 on average, contexts
# of ~1,600 tokens; computed from .gpu_data/sharegpt_1000.json's output lengths). 1) decode
# attention at such shapes: both caches, the automatic tiles and the fp8 cache's one-warp and
# narrow tiles, each with decode plans of min chunks TAIL_PLANS; 2) a decode step by kernel at
# PROFILE_BATCHES (4,16) sequences of PROFILE_CONTEXT (1,600) tokens, bf16 then fp8.
# Files back: decode_tail.{json,log}, decode_profile_{bf16,fp8}.{json,log}.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
echo "=== decode attention at the tail's shapes"
timeout 300 "$PY" scripts/decode_fp8_engine_shapes.py \
  --shapes "${TAIL_SHAPES:-1x1800,4x1600,8x1500,16x1400,16x900,32x1000,48x800}" --lengths fixed \
  --splits none --configs "${TAIL_CONFIGS:-32/1/3/8,64/2/3/4}" --bf16-configs 128/4/2 \
  --plan "${TAIL_PLANS:-32,64,128}" --budget-s 240 --commit "$PAGEDKV_COMMIT" \
  --output-json "$OUT/decode_tail.json" > "$OUT/decode_tail.log" 2>&1
echo "    exit $?"
grep -E "B=|best|rror" "$OUT/decode_tail.log" | grep -vE " run |plan B=" | sed "s/^.*INFO[^B]*//; s/ longest first=False//" | cut -c1-120 | tail -150
[[ "${TAIL_PROFILE:-1}" == 1 ]] || exit 0
PROFILE_BATCHES=${PROFILE_BATCHES:-4,16} PROFILE_CONTEXT=${PROFILE_CONTEXT:-1600} PROFILE_LINES=30 \
  bash scripts/gpu_fp8.sh profile
