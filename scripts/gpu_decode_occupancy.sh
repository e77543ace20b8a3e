#!/usr/bin/env bash
# One device call (carrying .whl and .gpu_commit): decode attention's programs an SM against
# what its launcher assumes (DecodeConfig.per_sm). 1) the GPU test that compares each shipped
# configuration's per_sm with its compiled kernel's occupancy; 2) the 16-bit and fp8 kernels
# without a plan at 64 sequences of 2k-32k tokens (and 16 x 4k, 256 x 2k), per_sm as shipped
# against the compiled count (the split count follows it); 3) the same by decode plans at the
# real-ShareGPT run's small batches (the plans' lanes follow per_sm).
# LENGTHS: the contexts (fixed, or a ShareGPT workload JSON); TAG: the files' suffix; OCC_TEST=0:
# no test; KV_ONLY=--bf16-only.
# Files back: occupancy_test.log, decode_unplanned.{json,log}, decode_planned.{json,log}.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
LENGTHS="${LENGTHS:-fixed}"  # or .gpu_data/sharegpt_1000.json: live requests' contexts
TAG="${TAG:-}"  # a suffix for the files of a second run in the same call
echo "=== per_sm against the compiled kernels"
if [[ "${OCC_TEST:-1}" == 1 ]]; then
  timeout 120 "$PY" -m pytest -q -m gpu tests/kernels/test_occupancy.py > "$OUT/occupancy_test.log" 2>&1
  echo "    exit $?"; grep -E "passed|failed|programs an SM|Error" "$OUT/occupancy_test.log" | cut -c1-200 | tail -20
fi
summary() { grep -E "B=|best|rror" "$1" | grep -vE " run |plan B=" | sed "s/^.*INFO[^B]*//; s/ longest first=False//" | cut -c1-120 | tail -120; }
echo "=== without a plan"
timeout 260 "$PY" scripts/decode_fp8_engine_shapes.py ${KV_ONLY:-} \
  --shapes "${UNPLANNED_SHAPES:-64x2048,64x4096,64x8192,64x32768,16x4096,256x2048}" --splits none --lengths "$LENGTHS" \
  --bf16-configs "${BF16_CONFIGS:-128/4/2/2+one_loop,128/4/2/3+one_loop,128/8/2/3+one_loop}" \
  --configs "${FP8_CONFIGS:-32/1/3/8,32/1/3/9}" --budget-s "${UNPLANNED_BUDGET:-230}" --commit "$PAGEDKV_COMMIT" \
  --output-json "$OUT/decode_unplanned$TAG.json" > "$OUT/decode_unplanned$TAG.log" 2>&1
echo "    exit $?"; summary "$OUT/decode_unplanned$TAG.log"
echo "=== by plans"
timeout 200 "$PY" scripts/decode_fp8_engine_shapes.py ${KV_ONLY:-} \
  --shapes "${PLANNED_SHAPES:-1x1800,8x1500,16x1400,32x1000,64x700}" --splits none --plan 128 --lengths "$LENGTHS" \
  --bf16-configs "${BF16_PLAN_CONFIGS:-128/4/2/2+one_loop,128/4/2/3+one_loop}" \
  --configs "${FP8_PLAN_CONFIGS:-32/1/3/8,32/1/3/9}" --budget-s "${PLANNED_BUDGET:-170}" --commit "$PAGEDKV_COMMIT" \
  --output-json "$OUT/decode_planned$TAG.json" > "$OUT/decode_planned$TAG.log" 2>&1
echo "    exit $?"; summary "$OUT/decode_planned$TAG.log"
