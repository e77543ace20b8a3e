#!/usr/bin/env bash
# Offline throughput on one H200 against Hugging Face transformers, measured in the same run
# (issue: "beat every baseline on the PagedAttention paper's workloads").
#
#   bash scripts/gpu_bench_throughput.sh [llama-sharegpt llama-alpaca llama-fixed opt-sharegpt ...]
#
# Each named run is one `pagedkv bench throughput` call, as `python3 -m pagedkv.bench.throughput`
# (the checkout is on PYTHONPATH there: no entry points for the `pagedkv` command): the engine
# on 1,000 requests (random token ids, lengths from the seeded workload, `ignore_eos`), then transformers `generate` with
# static batches and its continuous batching on the first HF_N of the same requests, then the
# roofline. Results: $OUT/throughput_<run>.json and .log. Models are the bundled shapes with
# random bf16 weights (`--load-format dummy`). Tunables: NUM_PROMPTS, HF_N, HF_BS (batch sizes),
# MAX_NUM_SEQS, MAX_BATCHED (tokens per pass), RUN_TIMEOUT, HF_TIME_LIMIT (seconds per transformers static-batch trial, whose
# rate is then measured on the tokens made so far), EXTRA (more bench options, e.g. --profile).
set -uo pipefail
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1

NUM_PROMPTS="${NUM_PROMPTS:-1000}"
# vLLM's defaults for offline runs on GPUs of 70+ GB (H100, H200): 1,024 sequences, 16,384 tokens
MAX_NUM_SEQS="${MAX_NUM_SEQS:-1024}"
MAX_BATCHED="${MAX_BATCHED:-16384}"
runs=("$@")
[[ ${#runs[@]} -eq 0 ]] && runs=(llama-sharegpt llama-alpaca llama-fixed opt-sharegpt)

common=(--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-batched-tokens "$MAX_BATCHED"
        --max-num-seqs "$MAX_NUM_SEQS" --num-prompts "$NUM_PROMPTS" --workload-seed 0
        --baseline hf --baseline hf-cb --hf-time-limit "${HF_TIME_LIMIT:-90}")
for run in "${runs[@]}"; do
  case "$run" in
    llama-*) model=meta-llama/Meta-Llama-3-8B ;;
    opt-*) model=facebook/opt-13b ;;
    *) echo "unknown run $run"; continue ;;
  esac
  case "$run" in
    *-sharegpt) wl=(--workload sharegpt --hf-num-prompts "${HF_N:-128}" --hf-batch-sizes "${HF_BS:-64,128}") ;;
    *-alpaca) wl=(--workload alpaca --hf-num-prompts "${HF_N:-256}" --hf-batch-sizes "${HF_BS:-128,256}") ;;
    *-fixed) wl=(--input-len 1024 --output-len 128 --hf-num-prompts "${HF_N:-128}" --hf-batch-sizes "${HF_BS:-32,64,128}") ;;
  esac
  # shellcheck disable=SC2206
  wl+=(${EXTRA:-})
  echo "=== $run: $model ${wl[*]}"
  timeout "${RUN_TIMEOUT:-480}" python3 -m pagedkv.bench.throughput --model "$model" \
    "${common[@]}" "${wl[@]}" --save-workload "/tmp/workload_${run}.json" \
    --output-json "$OUT/throughput_${run}.json" 2>&1 | grep -v -E "it/s\]|req/s\]|s/req\]" \
    | tee "$OUT/throughput_${run}.log" | grep -v -E "^\s*$" | tail -25
done
