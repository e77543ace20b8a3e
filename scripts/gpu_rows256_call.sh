#!/usr/bin/env bash
# One device call (carrying .whl, .gpu_commit and .gpu_data): should fp8_matmul take the decode
# matmuls of 129-256 rows? At 160 sequences a decode step's four cuBLAS fp8 matmuls
# (torch._scaled_mm past PAGEDKV_FP8_MATMUL_MAX_ROWS=128) took 112 us a layer against a 51-us
# memory bound (gpu_runs/2026-12-03c/decode_profile_fp8_160_384_435d6c2.log); fp8_matmul there
# lost in the run before (43de1e0), when its grid streamed the weights once per block of 128
# tokens; its M blocks now launch side by side and share each weight tile through L2.
# 1) the fp8_matmul GPU tests (two M blocks in the split test); 2) a Llama-3-8B layer's
# matmuls at 128-256 rows: bf16 F.linear, torch._scaled_mm on quantized rows, fp8_matmul as
# the engine calls it, and with all the tokens in one 256-wide tile (swap_m256); 3) the fp8
# run at the defaults and with PAGEDKV_FP8_MATMUL_MAX_ROWS=256, AB_ROUNDS (2) rounds
# interleaved, with the decode bands.
# Files back: fp8_matmul_gpu_tests.log, gemm_rows256.{json,log}, the run JSONs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
timeout 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs tests/kernels/test_fp8_matmul.py \
  > "$OUT/fp8_matmul_gpu_tests.log" 2>&1
echo "fp8_matmul gpu tests: exit $?"; tail -2 "$OUT/fp8_matmul_gpu_tests.log"
echo "=== a layer's matmuls at 128-256 rows"
timeout 200 "$PY" scripts/fp8_weight_only_gemm.py --m ${GEMM_ROWS:-128 160 192 256} \
  --only bf16,fp8_prequant,swap_pick,swap_m256 --budget-s 150 --commit "$PAGEDKV_COMMIT" \
  --output-json "$OUT/gemm_rows256.json" > "$OUT/gemm_rows256.log" 2>&1
echo "    exit $?"; grep -E "^layer|rror" "$OUT/gemm_rows256.log" | cut -c1-150
echo "=== the fp8 run, fp8_matmul up to 128 (base) and 256 rows"
ENV_AB="base: rows256:PAGEDKV_FP8_MATMUL_MAX_ROWS=256" ENV_AB_ROUNDS=${AB_ROUNDS:-2} \
  RUN_TIMEOUT=150 bash scripts/gpu_fp8.sh envab 2>&1 | grep -E "^(base|rows256)_r"
