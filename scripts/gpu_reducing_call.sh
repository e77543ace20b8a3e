#!/usr/bin/env bash
# One device call (carrying .whl, .gpu_commit and .gpu_data): should fp8_matmul take the
# reducing matmuls (weight out <= in: the output and down projections) past 128 rows? At
# 160-256 rows it ran them at 45-48% of the copy bandwidth against cuBLAS's 34-43% (O 10.5
# against 13.7 us, down 32.4 against 38.1 at 160), while cuBLAS kept Q/K/V and gate/up
# (gpu_runs/2026-12-03d/gemm_rows256.log, 1fef4fd).
# 1) the engine's GPU tests (pinned staging, fp8 linear paths, engine); 2) a layer's matmuls at
# GEMM_ROWS (384-1,024) rows, cuBLAS against fp8_matmul, per op; 3) one round (RATIO_ROUNDS=1)
# of the fp8/bf16 ratio at the defaults, then the fp8 run with
# PAGEDKV_FP8_MATMUL_MAX_ROWS_REDUCING=256 and =1024, with the decode bands.
# SKIP_PRE=1 skips 1) and 2) (a second round in a later call).
# Files back: engine_gpu_tests.log, gemm_reducing.{json,log}, the run JSONs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [[ "${SKIP_PRE:-0}" != 1 ]]; then
  timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs tests/engine/test_staging.py \
    tests/engine/test_fp8.py tests/engine/test_engine_gpu.py > "$OUT/engine_gpu_tests.log" 2>&1
  echo "engine gpu tests: exit $?"; tail -3 "$OUT/engine_gpu_tests.log"
  echo "=== a layer's matmuls, cuBLAS (fp8_prequant) against fp8_matmul (swap_pick)"
  timeout 150 "$PY" scripts/fp8_weight_only_gemm.py --m ${GEMM_ROWS:-384 512 768 1024} \
    --only fp8_prequant,swap_pick --budget-s 120 --commit "$PAGEDKV_COMMIT" \
    --output-json "$OUT/gemm_reducing.json" > "$OUT/gemm_reducing.log" 2>&1
  echo "    exit $?"; grep -E "^(o|down) |^layer|rror" "$OUT/gemm_reducing.log" | cut -c1-110
fi
echo "=== the ratio at the defaults"
RATIO_ROUNDS=1 RUN_TIMEOUT=150 bash scripts/gpu_fp8.sh ratio 2>&1 | grep -E "^round"
echo "=== fp8 with the reducing matmuls in fp8_matmul up to 256 and 1,024 rows"
ENV_AB="red256:PAGEDKV_FP8_MATMUL_MAX_ROWS_REDUCING=256 red1024:PAGEDKV_FP8_MATMUL_MAX_ROWS_REDUCING=1024" \
  ENV_AB_ROUNDS=1 RUN_TIMEOUT=150 bash scripts/gpu_fp8.sh envab 2>&1 | grep -E "^(red256|red1024|r1)"
for f in "$OUT"/throughput_*bf16*.json; do
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], round(d['output_tok_s']), 'mixed', round(d['mixed_seconds'], 2), {b: (round(v['gpu_ms_mean'], 3), round(v['seconds'], 2)) for b, v in d.get('decode_host_gap_by_batch', {}).items()})" "$f"
done
