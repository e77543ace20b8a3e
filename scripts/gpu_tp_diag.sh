#!/usr/bin/env bash
# Why is TP 2 slower than TP 1? (issue 17) One call on the 2-GPU H200 machine answers whether a
# rank lags, then measures the throughput at TP 1 and TP 2 again at this commit.
#
#   bash scripts/gpu_tp_diag.sh            # diag, then bench (about 6 minutes)
#   bash scripts/gpu_tp_diag.sh diag       # per-rank step timings only (about 2 minutes)
#
#   diag   scripts/tp_diag.py with PAGEDKV_TP_DIAG=1: the bench's workload (Llama-3-8B shape,
#          dummy bf16 weights, 1,000 ShareGPT-like requests, the issue's engine options) at
#          TP 2; prints per rank and per kind of pass (decode-graph / decode-eager /
#          prefill-mixed) and batch band the medians (p90) in ms of: wait (worker blocked for
#          the driver's message), host (up to the launch), sync (the device waiting for the
#          other rank at the step's start: a one-element all-reduce timed with CUDA events),
#          gpu (the pass's device time after that); and each rank's CUDA-graph replays and
#          eager passes. Reading: rank 0 sync large and rank 1 sync ~0 => rank 1 arrives late
#          (its host/wait say why); gpu ~13.6 ms at 257-512 (scripts/tp_allreduce_share.py
#          measured that in isolation) => the pass itself is fine.
#   bench  bash scripts/gpu_tp_run.sh llama8b assemble (TP 1 and TP 2 output tok/s, host wait
#          and GPU busy per band, $OUT/tensor_parallel.json).
# Output: $OUT/logs/tp_diag.log and .json (and the bench's logs), packed in $OUT/tp_logs.tar.gz.
set -uo pipefail
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
NUM_PROMPTS="${NUM_PROMPTS:-1000}"
BENCH_EXTRA="${BENCH_EXTRA:---max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 1024}"
DIAG_TIMEOUT="${DIAG_TIMEOUT:-240}"
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(diag bench)
want() { local p; for p in "${parts[@]}"; do [[ "$p" == "$1" ]] && return 0; done; return 1; }

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
pack() { tar -czf "$OUT/tp_logs.tar.gz" -C "$OUT" logs 2>/dev/null; }
trap pack EXIT

if want diag; then
  # shellcheck disable=SC2206
  cmd=(python3 scripts/tp_diag.py --model meta-llama/Meta-Llama-3-8B --tensor-parallel-size 2
       --load-format dummy --dtype bfloat16 --workload sharegpt --num-prompts "$NUM_PROMPTS"
       --output-json "$LOGS/tp_diag.json" $BENCH_EXTRA)
  echo "== tp_diag: PAGEDKV_TP_DIAG=1 ${cmd[*]}" | tee "$LOGS/tp_diag.log"
  PAGEDKV_TP_DIAG=1 timeout -k 20 "$DIAG_TIMEOUT" "${cmd[@]}" >>"$LOGS/tp_diag.log" 2>&1
  echo "== tp_diag: exit $?" | tee -a "$LOGS/tp_diag.log"
  grep -vE "INFO|it/s\]|req/s\]|^\s*$" "$LOGS/tp_diag.log" | tail -40
  sleep 2
  echo "== tp_diag: leftover processes: $(pgrep -fc 'multiprocessing.spawn|tp_diag.py')"
fi
if want bench; then
  OUT="$OUT" bash scripts/gpu_tp_run.sh llama8b assemble
fi
