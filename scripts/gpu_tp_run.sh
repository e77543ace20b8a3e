#!/usr/bin/env bash
# Tensor parallelism on the 2-GPU H200 machine (torch 2.11, triton 3.6, no network): the `gpu`
# tests of tests/engine/test_tensor_parallel.py (TP 2 == TP 1 over NCCL), then
# `pagedkv bench throughput` with dummy bf16 weights on a ShareGPT-like workload for the
# Llama-3-8B shape at TP 1 and TP 2 and the Llama-3-70B shape at TP 2, each under `timeout`.
# Logs and JSON go under $OUT; $OUT/tensor_parallel.json gathers the figures
# (docs/performance/tensor_parallel.json). Run from the repository root:
#
#   bash scripts/gpu_tp_run.sh [all|tests|llama8b|llama8b-tp1|llama8b-tp2|llama70b|assemble] ...
# (several parts allowed; BENCH_EXTRA adds options to every bench run)
#
# The parts fit in separate calls when one call is capped (10 minutes; the default timeouts
# keep each of these two calls under 9.5 minutes even when every part runs to its limit):
#   call 1: bash scripts/gpu_tp_run.sh tests llama8b assemble      (tests 200 s, 2 x 8B 180 s)
#   call 2: bash scripts/gpu_tp_run.sh llama70b assemble           (70B 540 s)
# then, here: python3 scripts/tp_assemble.py --output docs/performance/tensor_parallel.json \
#               <call 1 files> <call 2 files>
# NUM_PROMPTS (default 1000) and the *_TIMEOUT variables override the defaults below.
set -uo pipefail
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
mkdir -p "$OUT"
NUM_PROMPTS="${NUM_PROMPTS:-1000}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-200}"
BENCH8_TIMEOUT="${BENCH8_TIMEOUT:-180}"
BENCH70_TIMEOUT="${BENCH70_TIMEOUT:-540}"
parts=("$@")
[[ ${#parts[@]} -eq 0 ]] && parts=(all)
want() { local p; for p in "${parts[@]}"; do [[ "$p" == all || "$p" == "$1" ]] && return 0; done; return 1; }

source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m 2>/dev/null | head -5
  python3 -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "nccl", ".".join(map(str, torch.cuda.nccl.version())), "gpus", torch.cuda.device_count())'
  git rev-parse --short HEAD 2>/dev/null || true
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | sort
} > "$OUT/env_tp.txt" 2>&1
cat "$OUT/env_tp.txt"

if want tests; then
  timeout -k 15 "$TESTS_TIMEOUT" python3 -m pytest -m gpu tests/engine/test_tensor_parallel.py -q \
    -p no:cacheprovider -rs --durations=10 2>&1 | tee "$OUT/tp_gpu_tests.log" | tail -25
fi

# bench NAME MODEL TP SECONDS: one `pagedkv bench throughput` run (python3 -m pagedkv.bench.throughput)
# -> $OUT/NAME.json and NAME.log
bench() {
  local name="$1" model="$2" tp="$3" limit="$4"
  local cmd=(python3 -m pagedkv.bench.throughput --model "$model" --tensor-parallel-size "$tp"
             --load-format dummy --dtype bfloat16 --workload sharegpt --num-prompts "$NUM_PROMPTS"
             --output-json "$OUT/$name.json")
  # shellcheck disable=SC2206
  cmd+=(${BENCH_EXTRA:-})
  echo "== $name: ${cmd[*]}" | tee "$OUT/$name.log"
  local start=$SECONDS
  timeout -k 20 "$limit" "${cmd[@]}" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/$name.log"
  echo "${cmd[*]}" > "$OUT/$name.cmd"
  grep -iE "engine ready|tensor parallelism over|KV cache:|output_tok_s|Traceback|error" "$OUT/$name.log" | tail -8
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
  python3 scripts/tp_assemble.py --output "$OUT/tensor_parallel.json" "$OUT" && cat "$OUT/tensor_parallel.json"
fi
