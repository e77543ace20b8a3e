#!/usr/bin/env bash
# One device call (carrying .whl, .gpu_commit and .gpu_data): the fp8 decode kernel's one-warp
# tiles with their registers capped (DecodeConfig.maxnreg, PAGEDATTN_FP8_ONE_WARP_MAXNREG), so
# that 12 (168 registers) or 16 (128) programs share an SM instead of 8-9. At 160 sequences of
# 1,000 tokens the one-warp programs read the fp8 cache at 67% of the copy bandwidth
# (gpu_runs/2026-12-03c/); offline sm_90 compiles spill little at 168, more at 128.
# 1) the fp8 decode GPU tests of the narrow tiles, the capped one included, and the knob's test;
# 2) decode attention over real ShareGPT contexts at 96-768 sequences (longest first): the
# one-warp tiles at 8, 12 (168 registers) and 16 (128) programs per SM, each by the automatic
# splits and by a decode plan, next to the bf16 cache; 3) the fp8 run at the defaults and with
# each cap, AB_ROUNDS (1) rounds interleaved, with the decode bands.
# Files back: maxnreg_gpu_tests.log, decode_maxnreg.{json,log}, the run JSONs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
timeout 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs tests/kernels/test_fp8.py \
  -k "narrow_tiles or register_cap" > "$OUT/maxnreg_gpu_tests.log" 2>&1
echo "narrow-tile gpu tests: exit $?"; tail -2 "$OUT/maxnreg_gpu_tests.log"
echo "=== decode attention, one-warp tiles with and without a register cap"
timeout 260 "$PY" scripts/decode_fp8_engine_shapes.py \
  --shapes "${CAP_SHAPES:-96x0,160x0,384x0,768x0}" --lengths .gpu_data/sharegpt_1000.json \
  --longest-first --splits none --configs "${CAP_CONFIGS:-32/1/3/8,32/1/3/12/168,32/1/3/16/128}" \
  --bf16-configs 128/4/2 --plan 128 --budget-s 220 --commit "$PAGEDKV_COMMIT" \
  --output-json "$OUT/decode_maxnreg.json" > "$OUT/decode_maxnreg.log" 2>&1
echo "    exit $?"; grep -E "^B=|best|rror" "$OUT/decode_maxnreg.log" | cut -c1-150 | tail -70
echo "=== the fp8 run at the defaults and with the caps"
ENV_AB="base: cap168:PAGEDATTN_FP8_ONE_WARP_MAXNREG=168 cap128:PAGEDATTN_FP8_ONE_WARP_MAXNREG=128" \
  ENV_AB_ROUNDS=${AB_ROUNDS:-1} RUN_TIMEOUT=150 bash scripts/gpu_fp8.sh envab 2>&1 \
  | grep -E "^(base|cap168|cap128)_r"
