#!/usr/bin/env bash
# One device call (carrying .whl, .gpu_commit and .gpu_data): where an fp8 run's device waits.
#  1. the first replay of each captured CUDA graph against its second (scripts/graph_first_replay.py);
#  2. the phases of the first 40 steps and the caching allocator's calls by step kind
#     (scripts/sync_audit.py, the fp8 run of 1,000 real ShareGPT requests);
#  3. the GPU test of the throughput recorder's device waits;
#  4. the fp8/bf16 ratio, one round, with the new fields (device waits, allocator calls).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
C=${PAGEDKV_COMMIT:-unknown}
ENGINE=(--model meta-llama/Meta-Llama-3-8B --load-format dummy --dtype bfloat16 --max-model-len 2048
        --max-num-seqs 1024 --max-num-batched-tokens 16384)
FP8=(--quantization fp8 --kv-cache-dtype fp8)
timeout 240 "$PYTHON" scripts/graph_first_replay.py "${ENGINE[@]}" "${FP8[@]}" \
  --output-json "$OUT/graph_first_replay_fp8_$C.json" 2>&1 | grep -v " INFO " | tee "$OUT/graph_first_replay_fp8_$C.log"
timeout 300 "$PYTHON" scripts/sync_audit.py "${ENGINE[@]}" "${FP8[@]}" --dataset .gpu_data/sharegpt_1000.json \
  --num-prompts 1000 --warmup-steps 0 --trace-steps 40 --output-json "$OUT/sync_audit_fp8_$C.json" \
  > "$OUT/sync_audit_fp8_$C.log" 2>&1
grep -v " INFO " "$OUT/sync_audit_fp8_$C.log" | head -80
timeout 200 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_engine_gpu.py -k recorder 2>&1 \
  | tail -5 | tee "$OUT/recorder_gpu_test_$C.log"
RATIO_ROUNDS=${RATIO_ROUNDS:-1} bash scripts/gpu_fp8.sh ratio
