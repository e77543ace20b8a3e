#!/usr/bin/env bash
# Device calls (carrying .whl, .gpu_commit and .gpu_data) on where the device waits and what
# two streams would overlap; parts run in the order given (default: all, ~9 min: two calls).
#   first     the first replay of each captured CUDA graph against its second (fp8 engine;
#             scripts/graph_first_replay.py)
#   overlap   two half batches on two streams against the whole decode batch, bf16 then fp8
#             (scripts/overlap_probe.py)
#   recorder  the GPU test of the throughput recorder's device waits
#   audit     the first 40 steps' phases and the caching allocator's calls by step kind, the
#             fp8 run of 1,000 real ShareGPT requests (scripts/sync_audit.py)
#   ratio     the fp8/bf16 ratio, RATIO_ROUNDS (1) rounds, with the new JSON fields
#   graphtests  the engine's GPU tests of decode graphs (test_runner_graph_inputs, test_engine_gpu)
#   trace     a profiler trace of prompt and early decode steps of the fp8 run: the CUDA
#             runtime calls that keep the host waiting, with their stacks (scripts/step_trace.py)
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
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(first overlap recorder audit ratio)
quiet() { grep -v -e " INFO " -e "UserWarning" -e "_warn_once"; }
for part in "${parts[@]}"; do
  echo "=== $part"
  case $part in
    first)
      timeout 240 "$PYTHON" scripts/graph_first_replay.py "${ENGINE[@]}" "${FP8[@]}" \
        --output-json "$OUT/graph_first_replay_fp8_$C.json" 2>&1 | quiet | tee "$OUT/graph_first_replay_fp8_$C.log"
      ;;
    overlap)
      for kind in bf16 fp8; do
        extra=(); [[ $kind == fp8 ]] && extra=("${FP8[@]}")
        timeout 240 "$PYTHON" scripts/overlap_probe.py "${ENGINE[@]}" "${extra[@]}" \
          --gpu-memory-utilization 0.85 --batches 256,512,768,1024 --context 600 \
          --output-json "$OUT/overlap_probe_${kind}_$C.json" 2>&1 | quiet | tee "$OUT/overlap_probe_${kind}_$C.log"
      done
      ;;
    recorder)
      timeout 200 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_engine_gpu.py -k recorder 2>&1 \
        | tail -5 | tee "$OUT/recorder_gpu_test_$C.log"
      ;;
    audit)
      timeout 300 "$PYTHON" scripts/sync_audit.py "${ENGINE[@]}" "${FP8[@]}" --dataset .gpu_data/sharegpt_1000.json \
        --num-prompts 1000 --warmup-steps 0 --trace-steps 40 --output-json "$OUT/sync_audit_fp8_$C.json" \
        > "$OUT/sync_audit_fp8_$C.log" 2>&1
      quiet < "$OUT/sync_audit_fp8_$C.log" | head -80
      ;;
    graphtests)
      timeout 300 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_runner_graph_inputs.py \
        tests/engine/test_engine_gpu.py 2>&1 | tail -5 | tee "$OUT/graph_gpu_tests_$C.log"
      ;;
    trace)
      timeout 300 "$PYTHON" scripts/step_trace.py "${ENGINE[@]}" "${FP8[@]}" --dataset .gpu_data/sharegpt_1000.json \
        --num-prompts 1000 --steps "${TRACE_STEPS:-2-4,8-10,16-26}" --trace-dir /tmp/step_traces \
        --output-json "$OUT/step_trace_fp8_$C.json" > "$OUT/step_trace_fp8_$C.log" 2>&1
      quiet < "$OUT/step_trace_fp8_$C.log" | grep -v -e USDT -e "req/s" | head -150
      for f in /tmp/step_traces/*.json; do gzip -c "$f" > "$OUT/$(basename "$f" .json)_$C.json.gz"; done
      ls -la "$OUT"
      ;;
    ratio)
      RATIO_ROUNDS=${RATIO_ROUNDS:-1} bash scripts/gpu_fp8.sh ratio
      ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
