#!/usr/bin/env bash
# The PagedAttention paper's serving curve on the GPU machine (NVIDIA H200, no network): start
# `pagedkv serve` on Llama-3-8B's shape with random weights (bundled config, --load-format dummy,
# no tokenizer: token ids in, token ids out), sweep the request rate with `bench serve`
# (`python -m pagedkv.bench.serve`) on the ShareGPT-like workload, and keep normalized latency
# (s/token) against request rate, the sustainable rate under a latency bound, and issue 21's
# below-saturation figures: per rate the batch the server ran at (vllm:num_requests_running,
# sampled from /metrics), median TPOT, P99 ITL, whether it keeps up with its offered load, the
# knee; then the server is stopped and the offline engine, with the same engine options on the
# same GPU, times decode steps at each rate's batch size (`python -m pagedkv.bench.decode_step
# --sweep-json`), which writes each rate's `tpot_over_decode_step` and the sweep's
# `tpot_over_decode_step_max_below_knee` and `p99_itl_ms_max_below_knee` into the JSON. Under $OUT:
#   serve_sweep_llama3_8b.json  .png  .log (the benchmark's output)  _server.log
#   _decode_step.log (the offline decode steps)  env.txt
# STEP_TRACE=1 also has the engine core trace every step (`PAGEDKV_STEP_TRACE`, a little host
# time per step) and adds per rate where the steps' time went (`python -m
# pagedkv.bench.step_trace`: decode-only vs prefill steps, asynchronous share) to the JSON and
# to _steps.log; the trace itself is _steps.jsonl.
# Run from the repository root, carrying .whl (`bash scripts/gpu_wheels.sh` makes it: fastapi,
# uvicorn, pydantic, pyzmq, msgspec... are not on that machine):
#   bash scripts/gpu_serve_sweep.sh
# Every number is an environment variable (defaults below), e.g.
#   RATES=10,20,40 DURATION_S=10 bash scripts/gpu_serve_sweep.sh
# With the defaults it takes about 5-6 minutes on an H200; it stops itself within BUDGET_S seconds
# (the sweep gets what the server's start left, less DECODE_RESERVE_S for the offline decode
# steps); the JSON and the plot are rewritten after each rate and each batch size, so a cut run
# keeps what it measured.
# A CPU smoke run with the embedded model (no GPU, a few seconds of load):
#   SKIP_WHEELS=1 MODEL= PYTHON=.venv/bin/python SERVE_ARGS="--skip-tokenizer-init --kv-cache-gb 0.25" \
#   RATES=2,4 NUM_PROMPTS=6 DURATION_S=1 VOCAB_SIZE=49152 BENCH_EXTRA="--workload random \
#   --input-len 8 --output-len 4" DECODE_EXTRA="--steps 4" bash scripts/gpu_serve_sweep.sh
set -uo pipefail
start_s=$SECONDS
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
PYTHON="${PYTHON:-python3}"
MODEL="${MODEL-meta-llama/Meta-Llama-3-8B}"  # empty: the embedded model (a CPU smoke run)
# Engine options after the model; --skip-tokenizer-init because the bundled shape has no tokenizer.
SERVE_ARGS="${SERVE_ARGS:---load-format dummy --dtype bfloat16 --skip-tokenizer-init}"
PORT="${PORT:-8011}"
WORKLOAD="${WORKLOAD:-sharegpt}"        # mean input 161, output 338 tokens (the paper's ShareGPT)
# An H200 makes ~11-13k output tokens/s on this shape (offline, 1,024 sequences): 35-40 req/s
# of 338 tokens; with the server's 256 sequences at most it saturates somewhere between 35 and
# 60 req/s, so these rates cover the flat part, the knee and past it. Each rate sends the first
# rate x DURATION_S of the seeded requests (about DURATION_S seconds of arrivals): a backlog has
# time to build past the knee (a request lives ~5 s), and low rates do not take minutes.
RATES="${RATES:-10,20,30,40,50,60,70}"
DURATION_S="${DURATION_S:-15}"
NUM_PROMPTS="${NUM_PROMPTS:-1050}"      # the seeded pool: enough for the highest rate
LATENCY_BOUND="${LATENCY_BOUND:-0.2}"   # s/token: 5 tokens/s per user, about reading speed
PAUSE_S="${PAUSE_S:-2}"                 # between rates
WARMUP_REQUESTS="${WARMUP_REQUESTS:-16}"
VOCAB_SIZE="${VOCAB_SIZE:-128000}"      # random prompt ids below Llama 3's special tokens
BENCH_EXTRA="${BENCH_EXTRA:-}"          # more bench options (later ones win)
DECODE_EXTRA="${DECODE_EXTRA:-}"        # more pagedkv.bench.decode_step options
START_TIMEOUT_S="${START_TIMEOUT_S:-300}"
BUDGET_S="${BUDGET_S:-570}"             # the device's command limit is 600 s
DECODE_RESERVE_S="${DECODE_RESERVE_S:-90}"  # engine start and the decode steps, after the sweep
NAME="${NAME:-serve_sweep_llama3_8b}"
STEP_TRACE="${STEP_TRACE:-0}"
mkdir -p "$OUT"

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || true
  "$PYTHON" -c 'import sys, torch, fastapi, uvicorn, pydantic; print("python", sys.version.split()[0], "torch", torch.__version__, "fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__, "pydantic", pydantic.__version__)'
  git rev-parse --short HEAD 2>/dev/null || true
  echo "server: $MODEL $SERVE_ARGS"
  echo "sweep: workload $WORKLOAD, rates $RATES req/s, ${DURATION_S}s of arrivals each (pool $NUM_PROMPTS), bound $LATENCY_BOUND s/token"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# `pagedkv serve` without an installed distribution: the `pagedkv` command finds `serve` through
# an entry point, which only pip creates; `python -m pagedkv.server` is the same parser.
server_log="$OUT/${NAME}_server.log"
trace="$OUT/${NAME}_steps.jsonl"
if [[ "$STEP_TRACE" == 1 ]]; then rm -f "$trace"; export PAGEDKV_STEP_TRACE="$trace"; fi
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

# what stopping the server (up to 30 s) and the offline decode steps need
sweep_timeout=$((BUDGET_S - (SECONDS - start_s) - 30 - DECODE_RESERVE_S))
if (( sweep_timeout < 30 )); then echo "no time left for the sweep"; exit 1; fi
# shellcheck disable=SC2086  # BENCH_EXTRA is a list of options
timeout --signal=TERM "$sweep_timeout" "$PYTHON" -m pagedkv.bench.serve \
  --base-url "http://127.0.0.1:$PORT" --workload "$WORKLOAD" --num-prompts "$NUM_PROMPTS" \
  --request-rates "$RATES" --duration-per-rate "$DURATION_S" \
  --latency-bound "$LATENCY_BOUND" --pause-between-rates "$PAUSE_S" \
  --warmup-requests "$WARMUP_REQUESTS" --vocab-size "$VOCAB_SIZE" \
  --result-json "$OUT/$NAME.json" --plot "$OUT/$NAME.png" $BENCH_EXTRA \
  2>&1 | tee "$OUT/$NAME.log"
status=${PIPESTATUS[0]}
if [[ "$status" == 124 ]]; then
  echo "the sweep ran past ${sweep_timeout}s and was stopped: $OUT/$NAME.json holds the rates it finished"
fi
echo "--- server log (last lines) ---"; tail -n 15 "$server_log"
stop_server  # the GPU is the offline engine's now
trap - EXIT
# the engine core is the server's child: wait (at most 30 s) until no process holds the GPU
for _ in $(seq 1 30); do
  [[ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ]] && break
  sleep 1
done
echo "server stopped after $((SECONDS - start_s))s"
unset PAGEDKV_STEP_TRACE
if [[ "$STEP_TRACE" == 1 && -s "$OUT/$NAME.json" ]]; then
  "$PYTHON" -m pagedkv.bench.step_trace "$trace" --sweep-json "$OUT/$NAME.json" --write \
    2>&1 | tee "$OUT/${NAME}_steps.log"
fi

# The offline engine's decode step at each rate's batch size: same engine options, same GPU.
decode_timeout=$((BUDGET_S - (SECONDS - start_s) - 5))
if [[ ! -s "$OUT/$NAME.json" ]]; then
  echo "no sweep results: no offline decode steps"; exit 1
elif (( decode_timeout < 20 )); then
  echo "no time left for the offline decode steps"; decode_status=1
else
  # shellcheck disable=SC2086  # SERVE_ARGS and DECODE_EXTRA are lists of options
  timeout --signal=TERM "$decode_timeout" "$PYTHON" -m pagedkv.bench.decode_step \
    --sweep-json "$OUT/$NAME.json" ${MODEL:+--model "$MODEL"} $SERVE_ARGS $DECODE_EXTRA \
    2>&1 | tee "$OUT/${NAME}_decode_step.log"
  decode_status=${PIPESTATUS[0]}
fi
echo "total $((SECONDS - start_s))s"
if [[ "$status" != 0 ]]; then exit "$status"; fi
exit "$decode_status"
