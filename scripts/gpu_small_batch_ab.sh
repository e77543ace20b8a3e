#!/usr/bin/env bash
# One device call (carrying .whl and .gpu_commit): the GPU tests of this session's kernels
# (GPU_TESTS), the greedy argmax bench (the engine's argmax and pagedattn_kernels.argmax_rows)
# and a decode step by kernel of the fp8 model at PROFILE_BATCHES (16,64), PDL off: what the
# small-batch changes left of each kernel family. Files back: gpu_tests.log, greedy_argmax.json,
# decode_profile_fp8.json/.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
GPU_TESTS=${GPU_TESTS:-"tests/kernels/test_decode_plan.py tests/kernels/test_fp8_matmul.py tests/kernels/test_fused_ops.py tests/kernels/test_argmax_rows.py"}
tests=(); for t in $GPU_TESTS; do [[ -e $t ]] && tests+=("$t"); done
echo "=== gpu tests: ${tests[*]}"
timeout ${TEST_TIMEOUT:-240} "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs -x "${tests[@]}" > "$OUT/gpu_tests.log" 2>&1
echo "    exit $?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -8
echo "=== greedy argmax"
timeout 120 "$PY" scripts/greedy_argmax_bench.py --rounds 2 --output-json "$OUT/greedy_argmax.json" 2>&1 | tail -10
model=(--model meta-llama/Meta-Llama-3-8B --load-format dummy --dtype bfloat16)
echo "=== decode step profile (fp8)"
PAGEDATTN_PDL=0 timeout 200 "$PY" -m pagedkv.bench.decode_step --batch-sizes "${PROFILE_BATCHES:-16,64}" \
  --context 900 --steps 16 --warmup-steps 4 --profile-steps 4 "${model[@]}" --kv-cache-dtype fp8 \
  --quantization fp8 --max-model-len 2048 --max-num-seqs 1024 --max-num-batched-tokens 16384 \
  --output-json "$OUT/decode_profile_fp8.json" > "$OUT/decode_profile_fp8.log" 2>&1
echo "    exit $?"; grep -vE " INFO |Warn|warn_once" "$OUT/decode_profile_fp8.log" | head -60
