#!/usr/bin/env bash
# One call on the 2-GPU H200 machine that finishes the GPU work of the throughput and tensor
# parallelism issues (run from the repository root; outputs under $OUT):
#  0. the fused elementwise kernels against torch (scripts/gpu_fused_smoke.py); if they
#     disagree, the engine runs without them (PAGEDKV_FUSED_OPS=0) and the log says so;
#  1. at the same time, on separate GPUs: GPU 1 runs the Llama-3-8B ShareGPT-like throughput
#     bench against transformers (scripts/gpu_bench_throughput.sh), GPU 0 the 8B bench at TP 1;
#  2. both GPUs: the tensor-parallel `gpu` tests, the 8B bench at TP 2, the 70B bench at TP 2
#     (scripts/gpu_tp_run.sh), and the assembled tensor_parallel.json.
# Every log is packed into $OUT/logs.tar.gz (the machine returns at most 8 files).
set -uo pipefail
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
mkdir -p "$OUT/logs"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
pack() { tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs; }
trap pack EXIT

if ! timeout 120 python3 scripts/gpu_fused_smoke.py 2>&1 | tee "$OUT/logs/fused_smoke.log"; then
  echo "fused kernels disagree or failed: running without them" | tee -a "$OUT/logs/fused_smoke.log"
  export PAGEDKV_FUSED_OPS=0
fi
engine_opts="--max-model-len 2048 --max-num-batched-tokens 8192 --max-num-seqs 512"

( CUDA_VISIBLE_DEVICES=1 RUN_TIMEOUT="${SHAREGPT_TIMEOUT:-230}" HF_N="${HF_N:-64}" HF_BS="${HF_BS:-64}" \
    OUT="$OUT" bash scripts/gpu_bench_throughput.sh llama-sharegpt > "$OUT/logs/sharegpt_stdout.log" 2>&1 ) &
sharegpt=$!
CUDA_VISIBLE_DEVICES=0 NUM_PROMPTS="${TP_PROMPTS:-500}" BENCH8_TIMEOUT=150 BENCH_EXTRA="$engine_opts" \
  OUT="$OUT/logs" bash scripts/gpu_tp_run.sh llama8b-tp1
wait "$sharegpt"
tail -25 "$OUT/logs/sharegpt_stdout.log"
mv "$OUT"/throughput_llama-sharegpt.log "$OUT/logs/" 2>/dev/null

NUM_PROMPTS="${TP_PROMPTS:-500}" TESTS_TIMEOUT="${TESTS_TIMEOUT:-100}" BENCH8_TIMEOUT=120 \
  BENCH70_TIMEOUT="${BENCH70_TIMEOUT:-200}" BENCH_EXTRA="$engine_opts" OUT="$OUT/logs" \
  bash scripts/gpu_tp_run.sh tests llama8b-tp2 llama70b assemble
cp "$OUT/logs/tensor_parallel.json" "$OUT/" 2>/dev/null
ls -la "$OUT" "$OUT/logs"
