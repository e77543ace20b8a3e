#!/usr/bin/env bash
# Programmatic dependent launch on one H200, in one call (~7 min, carrying .gpu_data and
# .gpu_commit): a decode step with PAGEDATTN_PDL=1 and =0 (gpu_fp8.sh pdl, 16 and 64
# sequences), then the end-to-end runs of gpu_fp8.sh (real ShareGPT, 1,000 requests, no
# transformers baselines) interleaved: fp8 with and without PDL, bf16 with and without.
# Prints every figure; keeps under $OUT only the four throughput JSONs (a call returns 8 files).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export SKIP_WHEELS=1
source scripts/gpu_env.sh || exit 1
final=$OUT
export OUT=/tmp/pdl-out
mkdir -p "$OUT"
PDL_BATCHES=${PDL_BATCHES:-16,64} bash scripts/gpu_fp8.sh pdl 2>&1 | grep -E "PAGEDATTN_PDL|commit|H200"
for kind in fp8 bf16; do
  for pdl in 1 0; do
    echo "=== $kind end to end, PAGEDATTN_PDL=$pdl"
    PAGEDATTN_PDL=$pdl BASELINES_BF16=0 RUN_TIMEOUT=200 bash scripts/gpu_fp8.sh "$kind" 2>&1 \
      | grep -E "^pagedkv |roofline|decode batches|mixed passes|^\{'output" | cut -c1-260
    for f in "$OUT"/throughput_*.json; do mv "$f" "$final/pdl${pdl}_$(basename "$f")"; done
  done
done
