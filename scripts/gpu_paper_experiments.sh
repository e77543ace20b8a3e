#!/usr/bin/env bash
# The PagedAttention paper's GPU measurements on one H200 (issue 19), in one call, < 8 minutes.
#
#   bash scripts/gpu_paper_experiments.sh
#
# Writes JSON (and logs) to $OUT:
#   paper_kernels.json          paged decode/prefill attention per block size 8..128, Llama-3-8B
#                               and OPT-13B attention shapes (the kernel side of the paper's Fig. 18b)
#   paper_engine_llama3_8b.json per block size: output tok/s of one engine on the same ShareGPT
#                               requests (Fig. 18b end to end), and recompute vs swap (out + in)
#                               latency of a 256- and a 1,024-token sequence (Fig. 19a)
#   paper_sharing_<model>_<dataset>.json  KV blocks saved by parallel sampling and beam search
#                               (n, width 2, 4, 6) on ShareGPT (outputs capped at 256 tokens) and
#                               Alpaca-like lengths, 8 requests each (Fig. 15)
#   paper_prefix_<model>.json   1-/5-shot shared translation prefix, prefix cache off vs on, 64
#                               requests: blocks saved and throughput ratio (Figs. 16-17)
# Models are bundled shapes with random bf16 weights (--load-format dummy). Real ShareGPT
# requests come from .gpu_data/sharegpt_requests.json when carried (make it on a CPU machine:
# `python -m pagedkv.bench.paper_gpu prepare --num-prompts 500 --output-json
# .gpu_data/sharegpt_requests.json`; the GPU machine has neither the dataset nor the embedded
# tokenizer); without it, synthetic ShareGPT-like lengths (the JSON says which).
# Tunables: NUM_PROMPTS (engine sweep, 200), SHARE_N (requests per sharing run, 8), BUDGET_S
# (465: every step has its own limit too, and the python steps save what they measured so far).
set -uo pipefail
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
REQS=.gpu_data/sharegpt_requests.json
start=$SECONDS
left() { echo $(( ${BUDGET_S:-465} - (SECONDS - start) )); }
step() {  # step NAME SECONDS command...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  (( l < 20 )) && { echo "=== $name: skipped, budget spent"; return; }
  (( limit > l )) && limit=$l
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "    exit $?; $(tail -c 400 "$OUT/$name.log" | tail -1 | cut -c1-300)"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/paper_env.txt" 2>&1

step paper_kernels 60 python3 -m pagedkv.bench.paper_gpu kernels --output-json "$OUT/paper_kernels.json"
step paper_engine_llama3_8b 150 python3 -m pagedkv.bench.paper_gpu engine \
  --model meta-llama/Meta-Llama-3-8B --num-prompts "${NUM_PROMPTS:-200}" --requests-file "$REQS" \
  --output-json "$OUT/paper_engine_llama3_8b.json"

sg=sharegpt-synthetic; [[ -f $REQS ]] && sg=$REQS
common=(--load-format dummy --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.6
        --log-level WARNING)
for model in meta-llama/Meta-Llama-3-8B facebook/opt-13b; do
  short=${model##*/}; short=${short,,}
  step "paper_sharing_${short}_sharegpt" 60 python3 -m pagedkv.bench.sharing --model "$model" \
    "${common[@]}" --dataset "$sg" --num-prompts "${SHARE_N:-8}" --max-tokens 256
  step "paper_sharing_${short}_alpaca" 30 python3 -m pagedkv.bench.sharing --model "$model" \
    "${common[@]}" --dataset alpaca --num-prompts "${SHARE_N:-8}"
  step "paper_prefix_${short}" 45 python3 -m pagedkv.bench.sharing --model "$model" \
    "${common[@]}" --skip-parallel --skip-beam --prefix-shots 1,5 --prefix-requests 64
done
for f in "$OUT"/paper_sharing_*.log "$OUT"/paper_prefix_*.log; do  # the JSON line of each sharing run
  [[ -f $f ]] && tail -1 "$f" | python3 -c "import json,sys; json.loads(sys.stdin.read())" 2>/dev/null \
    && tail -1 "$f" > "${f%.log}.json"
done
echo "total $((SECONDS - start)) s; files in $OUT:"; ls "$OUT"
