#!/usr/bin/env bash
# One device call for the longest-first decode order and the fp8 long-sequence splits (run
# from the repository root, carrying .whl, .gpu_commit and .gpu_data), most wanted first (a
# call cut short keeps what it finished):
#  1. decode attention over real ShareGPT contexts at 128 and 384 sequences, batch order and
#     longest first, the automatic split and 4 forced ones of at least 512 tokens, both
#     caches; it picks LONG, the fp8 long-sequence split count of the runs below (4 if the
#     forced splits were faster longest first on fp8 at both shapes together, else 1);
#  2. the ShareGPT runs of `gpu_fp8.sh order`: fp8 longest first with LONG, bf16 longest
#     first, then both in batch order without long splits;
#  3. the GPU tests of the decode order and splits.
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
LONG=$(python3 - "$OUT/decode_realcontexts_splits.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, KeyError, ValueError):
    print(1); sys.exit()
us = {}
for r in rows:
    if r.get("kv") == "float8_e4m3fn" and r.get("longest_first") and "us" in r:
        us.setdefault(r["splits"], 0.0)
        us[r["splits"]] += r["us"]
print(4 if 4 in us and None in us and us[4] < us[None] else 1)
PY
)
echo "LONG=$LONG"
ORDER_RUNS="${ORDER_RUNS:-fp8:1:$LONG bf16:1:1 fp8:0:1 bf16:0:1}" RUN_TIMEOUT=130 bash scripts/gpu_fp8.sh order 2>&1 \
  | grep -E "^(fp8|bf16)|rror" | tail -12
timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_decode.py -k "order or split" 2>&1 | tail -2
