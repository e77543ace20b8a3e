#!/usr/bin/env bash
# Tensor parallelism on the 2-GPU H200 machine (torch 2.11, triton 3.6, no network), issue 17:
#   tests      the `gpu` tests of tests/engine/test_tensor_parallel.py (TP 2 == TP 1 over NCCL,
#              CUDA graphs replayed on every rank, asynchronous scheduling, a dead worker)
#   allreduce  NCCL's share of the Llama-3-8B decode step at TP 2, per batch size
#              (scripts/tp_allreduce_share.py under torchrun)
#   llama8b    `pagedkv bench throughput`, Llama-3-8B shape, TP 1 then TP 2 (llama8b-tp1,
#              llama8b-tp2 for one of them), dummy bf16 weights, ShareGPT-like workload
#   llama70b   the same for the Llama-3-70B shape at TP 2
#   assemble   $OUT/tensor_parallel.json from what this call measured (scripts/tp_assemble.py)
# Each part runs under `timeout`; after each bench run the script counts the processes it left.
# Logs go to $OUT/logs and are packed into $OUT/tp_logs.tar.gz (the machine returns few files).
# Run from the repository root:
#
#   bash scripts/gpu_tp_run.sh [all|tests|allreduce|llama8b|llama8b-tp1|llama8b-tp2|llama70b|assemble]...
#
# Two calls of at most 10 minutes (the default timeouts keep each under 9.5 minutes even when
# every part runs to its limit):
#   call 1: bash scripts/gpu_tp_run.sh llama8b allreduce assemble    (2 x 200 s + 150 s)
#   call 2: bash scripts/gpu_tp_run.sh llama70b tests assemble       (330 s + 240 s)
# then, here: python3 scripts/tp_assemble.py --output docs/performance/tensor_parallel.json \
#               <call 1>/tensor_parallel.json <call 2>/tensor_parallel.json
# NUM_PROMPTS (default 1000), BENCH_EXTRA (default: the issue's engine options) and the
# *_TIMEOUT variables override the defaults below.
set -uo pipefail
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
NUM_PROMPTS="${NUM_PROMPTS:-1000}"
BENCH_EXTRA="${BENCH_EXTRA:---max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 1024}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-240}"
ALLREDUCE_TIMEOUT="${ALLREDUCE_TIMEOUT:-150}"
BENCH8_TIMEOUT="${BENCH8_TIMEOUT:-200}"
BENCH70_TIMEOUT="${BENCH70_TIMEOUT:-330}"
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(all)
want() { local p; for p in "${parts[@]}"; do [[ "$p" == all || "$p" == "$1" ]] && return 0; done; return 1; }

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
pack() { tar -czf "$OUT/tp_logs.tar.gz" -C "$OUT" logs 2>/dev/null; }
trap pack EXIT
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  python3 -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "gpus", torch.cuda.device_count())'
  echo "commit ${PAGEDKV_COMMIT:-unknown}"
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort
} > "$LOGS/env_tp.txt" 2>&1
cat "$LOGS/env_tp.txt"

# leftovers NAME: processes of a finished part still running (spawned workers, bench, torchrun)
PATTERN='multiprocessing.spawn|pagedkv.bench.throughput|tp_allreduce_share|torch.distributed.run'
leftovers() {
  sleep 2
  local n
  n=$(pgrep -fc "$PATTERN")
  echo "== $1: leftover processes: $n" | tee -a "$LOGS/$1.log"
  [[ "$n" -gt 0 ]] && ps -o pid,ppid,etime,cmd -p "$(pgrep -d, -f "$PATTERN")" | tee -a "$LOGS/$1.log"
  return 0
}

if want tests; then
  timeout -k 15 "$TESTS_TIMEOUT" python3 -m pytest -m gpu tests/engine/test_tensor_parallel.py -q \
    -p no:cacheprovider -rs --durations=10 2>&1 | tee "$LOGS/tp_gpu_tests.log" | tail -25
  echo "== tests: exit ${PIPESTATUS[0]}" | tee -a "$LOGS/tp_gpu_tests.log"
fi

if want allreduce; then
  echo "== allreduce: NCCL share of the Llama-3-8B decode step at TP 2" | tee "$LOGS/tp_allreduce_8b.log"
  timeout -k 20 "$ALLREDUCE_TIMEOUT" python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    scripts/tp_allreduce_share.py --model meta-llama/Meta-Llama-3-8B \
    --batch-sizes 1,16,64,256,512,1024 --output "$LOGS/tp_allreduce_8b.json" \
    >>"$LOGS/tp_allreduce_8b.log" 2>&1
  echo "== allreduce: exit $?" | tee -a "$LOGS/tp_allreduce_8b.log"
  grep -E "^batch|Error|error" "$LOGS/tp_allreduce_8b.log" | tail -10
  leftovers tp_allreduce_8b
fi

# bench NAME MODEL TP SECONDS: one `pagedkv bench throughput` run -> $LOGS/NAME.json, .log, .cmd
bench() {
  local name="$1" model="$2" tp="$3" limit="$4"
  local cmd=(python3 -m pagedkv.bench.throughput --model "$model" --tensor-parallel-size "$tp"
             --load-format dummy --dtype bfloat16 --workload sharegpt --num-prompts "$NUM_PROMPTS"
             --output-json "$LOGS/$name.json")
  # shellcheck disable=SC2206
  cmd+=($BENCH_EXTRA)
  echo "== $name: ${cmd[*]}" | tee "$LOGS/$name.log"
  local start=$SECONDS
  timeout -k 20 "$limit" "${cmd[@]}" >>"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$LOGS/$name.log"
  echo "${cmd[*]}" > "$LOGS/$name.cmd"
  grep -iE "engine ready|tensor parallelism over|KV cache:|roofline|decode batches|output_tok_s|Traceback|error" \
    "$LOGS/$name.log" | grep -v '^{' | tail -14
  leftovers "$name"
}
if want llama8b || want llama8b-tp1; then
  bench llama8b_tp1 meta-llama/Meta-Llama-3-8B 1 "$BENCH8_TIMEOUT"
fi
if want llama8b || want llama8b-tp2; then
  bench llama8b_tp2 meta-llama/Meta-Llama-3-8B 2 "$BENCH8_TIMEOUT"
fi
if want llama70b; then
  bench llama70b_tp2 meta-llama/Meta-Llama-3-70B 2 "$BENCH70_TIMEOUT"
fi
if want assemble; then
  python3 scripts/tp_assemble.py --output "$OUT/tensor_parallel.json" "$LOGS" && cat "$OUT/tensor_parallel.json"
fi
