#!/usr/bin/env bash
# One device call (carrying .whl, .gpu_commit and .gpu_data): 1) SiLU-and-multiply to fp8 rows
# at prefill sizes (scripts/silu_fp8_rows.py); the fastest per-row variant at the largest size,
# where it beats the tiled pair by 10% or more, sets PAGEDATTN_SILU_FP8_ROW_CONFIG, and the
# fewest rows where it wins PAGEDATTN_SILU_FP8_ROW_MIN_ROWS; 2) the fused fp8 GPU tests under
# that setting; 3) the fp8 run with and without it (gpu_fp8.sh envab, AB_ROUNDS rounds);
# 4) fp8_matmul's 32-row tiles (--swap-set narrow). Files back: silu_fp8_rows.json,
# fused_fp8_rows_tests.log, the run JSONs, fp8_matmul_narrow.{json,log}.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
echo "=== silu_and_mul to fp8 rows"
timeout 200 "$PY" scripts/silu_fp8_rows.py --rows ${SILU_ROWS:-1024 4096 16384} \
  --commit "$PAGEDKV_COMMIT" --output-json "$OUT/silu_fp8_rows.json" 2>&1 | grep -vi warn | tail -30
pick=$("$PY" - "$OUT/silu_fp8_rows.json" <<'PY'
import json, re, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "us" in r and r["same"]]
top = max(r["rows"] for r in rows)
tiled = {r["rows"]: r["us"] for r in rows if r["variant"] == "tiled"}
per = [r for r in rows if r["rows"] == top and r["variant"] != "tiled"]
best = min(per, key=lambda r: r["us"], default=None)
if best is None or top not in tiled or best["us"] > 0.9 * tiled[top]:
    sys.exit(0)
wins = [r["rows"] for r in rows
        if r["variant"] == best["variant"] and r["us"] < tiled.get(r["rows"], 0)]
warps, reg = re.fullmatch(r"per_row_w(\d+)_r(\w+)", best["variant"]).groups()
print(min(wins), warps if reg == "None" else f"{warps}/{reg}")
PY
)
echo "pick: ${pick:-none (the tiled pair stays)}"
if [[ -n $pick ]]; then
  read -r min_rows config <<< "$pick"
  PAGEDATTN_SILU_FP8_ROW_MIN_ROWS=1 PAGEDATTN_SILU_FP8_ROW_CONFIG=$config timeout 200 "$PY" \
    -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fused_fp8.py \
    > "$OUT/fused_fp8_rows_tests.log" 2>&1
  echo "fused fp8 GPU tests, a program per row from 1 row ($config): exit $?"
  tail -2 "$OUT/fused_fp8_rows_tests.log"
  ENV_AB="base: rows:PAGEDATTN_SILU_FP8_ROW_MIN_ROWS=$min_rows,PAGEDATTN_SILU_FP8_ROW_CONFIG=$config" \
    ENV_AB_ROUNDS=${AB_ROUNDS:-1} RUN_TIMEOUT=170 bash scripts/gpu_fp8.sh envab 2>&1 \
    | grep -E "^(base|rows)_r"
fi
echo "=== fp8_matmul 32-row tiles"
timeout 200 "$PY" scripts/fp8_weight_only_gemm.py --m ${NARROW_ROWS:-1 4 16} \
  --only swap_pick,swap_fp8 --swap-set narrow --budget-s 150 --commit "$PAGEDKV_COMMIT" \
  --output-json "$OUT/fp8_matmul_narrow.json" > "$OUT/fp8_matmul_narrow.log" 2>&1
echo "    exit $?"; grep -E "swap|rror" "$OUT/fp8_matmul_narrow.log" | grep -v "^20" | cut -c1-110 | tail -60
