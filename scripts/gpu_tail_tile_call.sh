#!/usr/bin/env bash
# One device call (carrying .whl, .gpu_commit and .gpu_data; ~8 min) on the fp8 run's weak
# bands (issue 20, twenty-second session). Parts, in the order given (default: all):
#   tests   fp8_matmul's GPU tests (the tail tile of 129-192 rows among them)
#   rows1   fp8_matmul and bf16 F.linear at 1-16 rows, 2 and 1 interleaved: in a decode profile
#           (34eaf52) a step of 1 sequence spent 12% more in fp8_matmul than one of 2
#   tail    fp8_matmul with its tail tile against cuBLAS (fp8_prequant) at 144-192 rows, with
#           the pick's tiles and the small-row sweep's (stages cut to fit)
#   attn    decode attention at the run's tail shapes (1-64 sequences): the fp8 cache's wide
#           tiles with V loaded with K, with two stages, with the ragged tile in the loop, and
#           one warp, each by the automatic splits and by plans
#   envab   the fp8 run at the defaults, with 129-192 rows in fp8_matmul
#           (PAGEDKV_FP8_MATMUL_MAX_ROWS=192) and with one-warp tiles from 8 sequences
#           (PAGEDATTN_FP8_ONE_WARP_PAIRS=64), ENV_AB_ROUNDS (1) rounds
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
source scripts/gpu_env.sh || exit 1
C=${PAGEDKV_COMMIT:-unknown}
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(tests rows1 tail attn envab)
for part in "${parts[@]}"; do
  echo "=== $part"
  case $part in
    tests)
      timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fp8_matmul.py 2>&1 \
        | tail -4 | tee "$OUT/fp8_matmul_gpu_tests_$C.log"
      ;;
    rows1)
      timeout 120 "$PY" scripts/fp8_weight_only_gemm.py --m 2 1 2 1 4 16 --only swap_pick,bf16 \
        --swap-set pick --commit "$C" --output-json "$OUT/fp8_matmul_rows1_$C.json" 2>&1 \
        | grep -E " M=" | cut -c1-120 | tee "$OUT/fp8_matmul_rows1_$C.log"
      ;;
    tail)
      timeout 240 "$PY" scripts/fp8_weight_only_gemm.py --m 144 160 176 192 \
        --only swap_pick,fp8_prequant,swap_fp8,bf16 --swap-set pick --budget-s 200 --commit "$C" \
        --output-json "$OUT/fp8_matmul_tail_$C.json" 2>&1 | grep -E " M=" | cut -c1-120 \
        | tee "$OUT/fp8_matmul_tail_$C.log"
      ;;
    attn)
      TAIL_SHAPES="${TAIL_SHAPES:-1x1800,2x1700,4x1600,8x1500,16x1400,32x1000,64x700}" \
        TAIL_CONFIGS="${TAIL_CONFIGS:-128/4/3/2/1,128/4/2/2,128/4/3/2/0/1/0/1,32/1/3/8}" \
        TAIL_PLANS=128 TAIL_PROFILE=0 OUT=/tmp/pagedkv-tail bash scripts/gpu_tail_call.sh
      cp /tmp/pagedkv-tail/decode_tail.json "$OUT/decode_tail_$C.json"
      cp /tmp/pagedkv-tail/decode_tail.log "$OUT/decode_tail_$C.log"
      ;;
    envab)
      ENV_AB="base: rows192:PAGEDKV_FP8_MATMUL_MAX_ROWS=192 ow64:PAGEDATTN_FP8_ONE_WARP_PAIRS=64" \
        ENV_AB_ROUNDS=${ENV_AB_ROUNDS:-1} bash scripts/gpu_fp8.sh envab
      ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
