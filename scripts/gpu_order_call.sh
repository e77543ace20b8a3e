#!/usr/bin/env bash
# One device call for the longest-first decode order (run from the repository root, carrying
# .whl, .gpu_commit and .gpu_data), most wanted first (a call cut short keeps what it
# finished):
#  1. decode attention over real ShareGPT contexts (SWEEP_SHAPES: 128 and 384 sequences),
#     batch order and longest first, the automatic split and 4 forced ones of at least 512
#     tokens, both caches;
#  2. the ShareGPT runs of `gpu_fp8.sh order`: fp8 and bf16 longest first, then both in
#     batch order;
#  3. the GPU tests of the decode order and splits.
# The fourteenth session ran it at 209e79d as `SWEEP_SHAPES=384x0 SWEEP_BUDGET=30 bash
# scripts/gpu_order_call.sh`, when the runs still took a long-split count (1 in all four).
# At most 8 files come back: the four run JSONs, fp8_env.txt, the sweep's log and JSON.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
timeout 120 python3 scripts/decode_fp8_engine_shapes.py --shapes "${SWEEP_SHAPES:-128x0,384x0}" \
  --lengths .gpu_data/sharegpt_1000.json --longest-first --automatic-configs --splits 4 \
  --min-partition 512 --split-max-batch 1024 --budget-s "${SWEEP_BUDGET:-100}" --commit "${PAGEDKV_COMMIT:-}" \
  --output-json "$OUT/decode_realcontexts_splits.json" > "$OUT/decode_realcontexts_splits.log" 2>&1
grep -E "B=" "$OUT/decode_realcontexts_splits.log" | grep -v " run " | grep -v best \
  | sed -E 's/^.*INFO[^B]*//; s/ +/ /g'
ORDER_RUNS="${ORDER_RUNS:-fp8:1 bf16:1 fp8:0 bf16:0}" RUN_TIMEOUT=130 bash scripts/gpu_fp8.sh order 2>&1 \
  | grep -E "^(fp8|bf16)|rror" | tail -12
timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_decode.py -k "order or split" 2>&1 | tail -2
