#!/usr/bin/env bash
# One device call for the longest-first decode order and the fp8 long-sequence splits (run
# from the repository root, carrying .whl, .gpu_commit and .gpu_data):
#  1. the ShareGPT runs of `gpu_fp8.sh order` (fp8 longest first with and without long
#     splits, bf16 longest first, then both in batch order);
#  2. decode attention over real ShareGPT contexts, batch order and longest first, with the
#     automatic split and forced ones (2, 4; at least 512 tokens a program) up to 768
#     sequences, both caches;
#  3. the GPU tests of the decode order and splits.
# At most 8 files come back: the five run JSONs, fp8_env.txt and the two logs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
RUN_TIMEOUT=130 bash scripts/gpu_fp8.sh order 2>&1 | grep -E "^(fp8|bf16)|rror" | tail -12
timeout 200 python3 scripts/decode_fp8_engine_shapes.py --shapes 64x0,128x0,256x0,384x0,768x0 \
  --lengths .gpu_data/sharegpt_1000.json --longest-first --automatic-configs --splits 2,4 \
  --min-partition 512 --split-max-batch 1024 --budget-s 170 --commit "${PAGEDKV_COMMIT:-}" \
  --output-json /tmp/realcontexts.json > "$OUT/decode_realcontexts_splits.log" 2>&1
grep -E "B=" "$OUT/decode_realcontexts_splits.log" | grep -v " run " \
  | sed -E 's/^.*INFO[^B]*//; s/ +/ /g' | tail -45
timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_decode.py -k "order or split" 2>&1 | tail -2
