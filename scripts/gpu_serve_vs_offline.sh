#!/usr/bin/env bash
# The server against the offline engine on the GPU machine (NVIDIA H200, no network), in one
# call: `pagedkv bench serve --compare-offline` runs the offline engine on 1,000 ShareGPT-like
# requests (`pagedkv.bench.throughput --dataset`, the exact requests), then starts
# `python -m pagedkv.server` with the same engine options (those of
# `scripts/gpu_bench_throughput.sh llama-sharegpt`: Llama-3-8B's shape, random bf16 weights,
# 1,024 sequences, 16,384-token passes, context 2,048; no tokenizer: token ids in and out) and
# sends the same requests all at once, streaming, then non-streaming. Under $OUT:
#   serve_vs_offline_llama3_8b.json   offline_output_tok_s, serve_output_tok_s, serve_over_offline,
#                                     non-streaming, TPOT/ITL percentiles, TTFT split, CPU shares
#   serve_vs_offline_llama3_8b.log    the benchmark's output        env.txt
# Run from the repository root, carrying .whl (bash scripts/gpu_wheels.sh makes it: fastapi,
# uvicorn, pydantic, pyzmq, msgspec... are not on that machine) and .gpu_commit:
#   bash scripts/gpu_serve_vs_offline.sh
# then, for the request-rate sweep (serve_sweep_llama3_8b.json and .png), a second call:
#   bash scripts/gpu_serve_sweep.sh
# Tunables (environment): NUM_PROMPTS, REPEATS (default 2, interleaved; each repeat starts both
# engines and runs the requests three times: an estimated 3 minutes on an H200; the JSON is
# rewritten after each repeat, so a run cut short keeps what it finished), MAX_NUM_SEQS,
# MAX_BATCHED, BENCH_EXTRA, BUDGET_S.
set -uo pipefail
start_s=$SECONDS
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
PYTHON="${PYTHON:-python3}"
NUM_PROMPTS="${NUM_PROMPTS:-1000}"
REPEATS="${REPEATS:-2}"
MAX_NUM_SEQS="${MAX_NUM_SEQS:-1024}"
MAX_BATCHED="${MAX_BATCHED:-16384}"
MODEL="${MODEL:-meta-llama/Meta-Llama-3-8B}"
ENGINE_ARGS="${ENGINE_ARGS:---model $MODEL --load-format dummy --dtype bfloat16 --skip-tokenizer-init --max-model-len 2048 --max-num-batched-tokens $MAX_BATCHED --max-num-seqs $MAX_NUM_SEQS}"
BENCH_EXTRA="${BENCH_EXTRA:-}"
BUDGET_S="${BUDGET_S:-580}"   # the device's command limit is 600 s
NAME="${NAME:-serve_vs_offline_llama3_8b}"
mkdir -p "$OUT"

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || true
  "$PYTHON" -c 'import sys, torch, fastapi, uvicorn, zmq, msgspec; print("python", sys.version.split()[0], "torch", torch.__version__, "fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__, "pyzmq", zmq.__version__, "msgspec", msgspec.__version__)'
  echo "commit ${PAGEDKV_COMMIT:-unknown}; engine options: $ENGINE_ARGS"
  echo "$NUM_PROMPTS sharegpt-like requests, $REPEATS repeat(s), cpu cores $(nproc)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# shellcheck disable=SC2086  # BENCH_EXTRA is a list of options
timeout --signal=TERM "$((BUDGET_S - (SECONDS - start_s)))" "$PYTHON" -m pagedkv.bench.serve \
  --compare-offline --engine-args "$ENGINE_ARGS" --repeats "$REPEATS" \
  --workload sharegpt --num-prompts "$NUM_PROMPTS" --vocab-size 128000 --warmup-requests 16 \
  --server-start-timeout 300 --offline-timeout 300 \
  --result-json "$OUT/$NAME.json" $BENCH_EXTRA 2>&1 | tee "$OUT/$NAME.log"
status=${PIPESTATUS[0]}
echo "total $((SECONDS - start_s))s, exit $status"
exit "$status"
