#!/usr/bin/env bash
# The PagedAttention paper's serving curve on the GPU machine (NVIDIA H200, no network): start
# `pagedkv serve` on Llama-3-8B's shape with random weights (bundled config, --load-format dummy,
# no tokenizer: token ids in, token ids out), sweep the request rate with `bench serve`
# (`python -m pagedkv.bench.serve`) on the ShareGPT-like workload, and keep normalized latency
# (s/token) against request rate, the sustainable rate under a latency bound, the plot and both
# logs under $OUT:
#   serve_sweep_llama3_8b.json  .png  .log (the benchmark's output)  _server.log   env.txt
# Run from the repository root, carrying .whl (`bash scripts/gpu_wheels.sh` makes it: fastapi,
# uvicorn, pydantic, pyzmq, msgspec... are not on that machine):
#   bash scripts/gpu_serve_sweep.sh
# Every number is an environment variable (defaults below), e.g.
#   RATES=10,20,40 NUM_PROMPTS=200 bash scripts/gpu_serve_sweep.sh
# The whole script stops itself within BUDGET_S seconds (the sweep gets what the server's start
# left); the JSON and the plot are rewritten after each rate, so a cut run keeps what it measured.
set -uo pipefail
start_s=$SECONDS
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
PYTHON="${PYTHON:-python3}"
MODEL="${MODEL-meta-llama/Meta-Llama-3-8B}"  # empty: the embedded model (a CPU smoke run)
# Engine options after the model; --skip-tokenizer-init because the bundled shape has no tokenizer.
SERVE_ARGS="${SERVE_ARGS:---load-format dummy --dtype bfloat16 --skip-tokenizer-init}"
PORT="${PORT:-8011}"
WORKLOAD="${WORKLOAD:-sharegpt}"        # mean input 161, output 338 tokens (the paper's ShareGPT)
NUM_PROMPTS="${NUM_PROMPTS:-300}"       # requests at each rate (the same seeded set)
# An H200 running an 8B model makes roughly 10-20k output tokens/s: 30-60 req/s of 338 tokens
# saturate it, so these rates cover the flat part, the knee and past it.
RATES="${RATES:-5,10,20,30,40,60}"
LATENCY_BOUND="${LATENCY_BOUND:-0.2}"   # s/token: 5 tokens/s per user, about reading speed
PAUSE_S="${PAUSE_S:-2}"                 # between rates
WARMUP_REQUESTS="${WARMUP_REQUESTS:-16}"
VOCAB_SIZE="${VOCAB_SIZE:-128000}"      # random prompt ids below Llama 3's special tokens
BENCH_EXTRA="${BENCH_EXTRA:-}"          # more bench options (later ones win)
START_TIMEOUT_S="${START_TIMEOUT_S:-300}"
BUDGET_S="${BUDGET_S:-570}"             # the device's command limit is 600 s
NAME="${NAME:-serve_sweep_llama3_8b}"
mkdir -p "$OUT"

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || true
  "$PYTHON" -c 'import sys, torch, fastapi, uvicorn, pydantic; print("python", sys.version.split()[0], "torch", torch.__version__, "fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__, "pydantic", pydantic.__version__)'
  git rev-parse --short HEAD 2>/dev/null || true
  echo "server: $MODEL $SERVE_ARGS"
  echo "sweep: workload $WORKLOAD, $NUM_PROMPTS requests per rate, rates $RATES req/s, bound $LATENCY_BOUND s/token"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# `pagedkv serve` without an installed distribution: the `pagedkv` command finds `serve` through
# an entry point, which only pip creates; `python -m pagedkv.server` is the same parser.
server_log="$OUT/${NAME}_server.log"
# shellcheck disable=SC2086  # SERVE_ARGS is a list of options
"$PYTHON" -m pagedkv.server ${MODEL:+"$MODEL"} $SERVE_ARGS --host 127.0.0.1 --port "$PORT" \
  --uvicorn-log-level warning > "$server_log" 2>&1 &
server_pid=$!

stop_server() {
  if kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$server_pid" 2>/dev/null
  fi
  wait "$server_pid" 2>/dev/null
}
trap stop_server EXIT

echo "waiting for http://127.0.0.1:$PORT/health (at most ${START_TIMEOUT_S}s)"
ready=0
for _ in $(seq 1 "$START_TIMEOUT_S"); do
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "the server exited during startup; its log:"; tail -n 60 "$server_log"; exit 1
  fi
  if "$PYTHON" -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
    ready=1; break
  fi
  sleep 1
done
if [[ "$ready" != 1 ]]; then
  echo "the server was not healthy after ${START_TIMEOUT_S}s; its log:"; tail -n 60 "$server_log"; exit 1
fi
echo "server ready after $((SECONDS - start_s))s"

sweep_timeout=$((BUDGET_S - (SECONDS - start_s) - 40))  # 40 s: stopping the server, copying out
if (( sweep_timeout < 30 )); then echo "no time left for the sweep"; exit 1; fi
# shellcheck disable=SC2086  # BENCH_EXTRA is a list of options
timeout --signal=TERM "$sweep_timeout" "$PYTHON" -m pagedkv.bench.serve \
  --base-url "http://127.0.0.1:$PORT" --workload "$WORKLOAD" --num-prompts "$NUM_PROMPTS" \
  --request-rates "$RATES" --latency-bound "$LATENCY_BOUND" --pause-between-rates "$PAUSE_S" \
  --warmup-requests "$WARMUP_REQUESTS" --vocab-size "$VOCAB_SIZE" \
  --result-json "$OUT/$NAME.json" --plot "$OUT/$NAME.png" $BENCH_EXTRA \
  2>&1 | tee "$OUT/$NAME.log"
status=$?
if [[ "$status" == 124 ]]; then
  echo "the sweep ran past ${sweep_timeout}s and was stopped: $OUT/$NAME.json holds the rates it finished"
fi
echo "--- server log (last lines) ---"; tail -n 15 "$server_log"
echo "total $((SECONDS - start_s))s"
exit "$status"
