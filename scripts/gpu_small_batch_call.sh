#!/usr/bin/env bash
# One device call (carrying .whl and .gpu_commit): where the run's small decode batches can
# still lose time. 1) the greedy token after the LM head: float32 cast + argmax against the
# argmax of the model-dtype logits; 2) fp8_matmul's per-shape pick against the refine sweep's
# winners at 1-64 rows (--swap-set pick); 3) a decode step by kernel at PROFILE_BATCHES (16,64)
# sequences with decode plans, bf16 then fp8 (PDL off). Files back: greedy_argmax.json,
# fp8_matmul_pick.json/.log, decode_profile_{bf16,fp8}.json/.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
echo "=== greedy argmax"
timeout 120 "$PY" scripts/greedy_argmax_bench.py --output-json "$OUT/greedy_argmax.json" 2>&1 | tail -12
echo "=== fp8_matmul pick"
timeout 240 "$PY" scripts/fp8_weight_only_gemm.py --m ${PICK_ROWS:-1 8 16 24 32 48 64} \
  --only swap_pick,swap_fp8 --swap-set pick --budget-s 200 --commit "$PAGEDKV_COMMIT" \
  --output-json "$OUT/fp8_matmul_pick.json" > "$OUT/fp8_matmul_pick.log" 2>&1
echo "    exit $?"; grep -E "swap layer|error|Error" "$OUT/fp8_matmul_pick.log" | head -40
PROFILE_BATCHES=${PROFILE_BATCHES:-16,64} PROFILE_LINES=45 bash scripts/gpu_fp8.sh profile
