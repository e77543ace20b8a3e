#!/usr/bin/env bash
# Device calls (carrying .whl, .gpu_commit and .gpu_data) on the fp8 run's small decode batches
# (issue 20, twenty-second session). Parts, in the order given (default: tests rows1 long
# ratio, ~7 min):
#   tests   the GPU tests of fp8_matmul, decode plans and the fp8 decode tiles, and the
#           engine's fp8 tests
#   rows1   fp8_matmul and bf16 F.linear at 1-48 rows, 2 and 1 interleaved: with the padding
#           columns re-reading valid rows (% M), a layer's matmuls took 75.3 us at 1 row
#           against 66.0 at 2 (d6eeae7); since then the padding is masked out of the loads
#   attn    decode attention at the run's tail shapes (1-64 sequences): the fp8 cache's wide
#           tiles with V loaded with K, with two stages, with the ragged tile in the loop, and
#           one warp, each by the automatic splits and by plans (run at d6eeae7)
#   long    the same for long contexts (8 x 4k, 16 x 8k, 32 x 2k): the automatic tiles
#           (by a plan, one warp from 8 sequences) against the wide ones
#   envab   the fp8 run at the defaults and with one-warp tiles from 8 sequences
#           (PAGEDATTN_FP8_ONE_WARP_PAIRS=64), ENV_AB_ROUNDS (1) rounds (run at d6eeae7, with
#           a third setting: 129-192 rows in fp8_matmul's tail tile, since removed)
#   ratio   the fp8/bf16 ratio, RATIO_ROUNDS (2) rounds
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
source scripts/gpu_env.sh || exit 1
C=${PAGEDKV_COMMIT:-unknown}
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(tests rows1 long ratio)
for part in "${parts[@]}"; do
  echo "=== $part"
  case $part in
    tests)
      timeout 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fp8_matmul.py \
        tests/kernels/test_decode_plan.py tests/kernels/test_fp8.py tests/engine/test_fp8.py 2>&1 \
        | tail -6 | tee "$OUT/small_batch_gpu_tests_$C.log"
      ;;
    rows1)
      timeout 120 "$PY" scripts/fp8_weight_only_gemm.py --m 2 1 2 1 4 8 16 48 --only swap_pick,bf16 \
        --swap-set pick --commit "$C" --output-json "$OUT/fp8_matmul_rows1_$C.json" 2>&1 \
        | grep -E " M=" | cut -c1-120 | tee "$OUT/fp8_matmul_rows1_$C.log"
      ;;
    attn)
      TAIL_SHAPES="${TAIL_SHAPES:-1x1800,2x1700,4x1600,8x1500,16x1400,32x1000,64x700}" \
        TAIL_CONFIGS="${TAIL_CONFIGS:-128/4/3/2/1,128/4/2/2,128/4/3/2/0/1/0/1,32/1/3/8}" \
        TAIL_PLANS=128 TAIL_PROFILE=0 OUT=/tmp/pagedkv-tail bash scripts/gpu_tail_call.sh
      cp /tmp/pagedkv-tail/decode_tail.json "$OUT/decode_tail_$C.json"
      cp /tmp/pagedkv-tail/decode_tail.log "$OUT/decode_tail_$C.log"
      ;;
    envab)
      ENV_AB="base: ow64:PAGEDATTN_FP8_ONE_WARP_PAIRS=64" \
        ENV_AB_ROUNDS=${ENV_AB_ROUNDS:-1} bash scripts/gpu_fp8.sh envab
      ;;
    long)
      TAIL_SHAPES="8x4096,16x8192,32x2000" TAIL_CONFIGS="128/4/3/2" TAIL_PLANS=128 TAIL_PROFILE=0 \
        OUT=/tmp/pagedkv-long bash scripts/gpu_tail_call.sh
      cp /tmp/pagedkv-long/decode_tail.json "$OUT/decode_long_$C.json"
      cp /tmp/pagedkv-long/decode_tail.log "$OUT/decode_long_$C.log"
      ;;
    ratio)
      RATIO_ROUNDS=${RATIO_ROUNDS:-2} bash scripts/gpu_fp8.sh ratio
      ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
