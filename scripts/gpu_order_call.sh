#!/usr/bin/env bash
# One device call for the longest-first decode order (run from the repository root, carrying
# .whl, .gpu_commit and .gpu_data): the fp8 and bf16 ShareGPT runs with and without it
# (`gpu_fp8.sh order`), decode attention over real contexts in both orders
# (`gpu_fp8.sh realcontexts`), the GPU decode tests of the order and the split, then forced
# splits of long sequences at 128-384 sequences, longest first (min partition 512).
# At most 8 files come back: the four run JSONs, fp8_env.txt, decode_realcontexts.{json,log},
# split512.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
RUN_TIMEOUT=130 bash scripts/gpu_fp8.sh order 2>&1 | grep -E "^(fp8|bf16)|output_tok_s|rror" | tail -12
bash scripts/gpu_fp8.sh realcontexts 2>&1 | grep -E "B=" | grep -v " run " \
  | sed -E "s/^.*INFO[^B]*//; s/ +/ /g" | tail -30
timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_decode.py -k "order or split" 2>&1 | tail -2
timeout 120 python3 scripts/decode_fp8_engine_shapes.py --shapes 128x0,256x0,384x0 \
  --lengths .gpu_data/sharegpt_1000.json --longest-first --automatic-configs --splits 2,4 \
  --min-partition 512 --split-max-batch 512 --budget-s 90 --commit "${PAGEDKV_COMMIT:-}" \
  --output-json /tmp/split512.json > "$OUT/split512.log" 2>&1
grep -E "B=" "$OUT/split512.log" | grep -v " run " | sed -E 's/^.*INFO[^B]*//; s/ +/ /g' | tail -30
