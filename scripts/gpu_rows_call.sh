#!/usr/bin/env bash
# One device call (carrying .whl and .gpu_commit): 1) SiLU-and-multiply to fp8 rows at prefill
# sizes, the tiled pair against a program per row with other warps and register caps
# (scripts/silu_fp8_rows.py); 2) fp8_matmul's 32-row weight tiles against the pick at 1-32
# rows (scripts/fp8_weight_only_gemm.py --swap-set narrow). Files back: silu_fp8_rows.json,
# fp8_matmul_narrow.{json,log}.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
echo "=== silu_and_mul to fp8 rows"
timeout 200 "$PY" scripts/silu_fp8_rows.py --rows ${SILU_ROWS:-256 1024 4096 16384} \
  --commit "$PAGEDKV_COMMIT" --output-json "$OUT/silu_fp8_rows.json" 2>&1 | grep -vi warn | tail -40
echo "=== fp8_matmul 32-row tiles"
timeout 240 "$PY" scripts/fp8_weight_only_gemm.py --m ${NARROW_ROWS:-1 4 8 16 32} \
  --only swap_pick,swap_fp8 --swap-set narrow --budget-s 200 --commit "$PAGEDKV_COMMIT" \
  --output-json "$OUT/fp8_matmul_narrow.json" > "$OUT/fp8_matmul_narrow.log" 2>&1
echo "    exit $?"; grep -E "swap|error|Error" "$OUT/fp8_matmul_narrow.log" | grep -v "^20" | cut -c1-110 | tail -80
