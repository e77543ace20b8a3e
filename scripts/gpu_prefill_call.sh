#!/usr/bin/env bash
# One device call (run from the repository root, carrying .whl and .gpu_commit), most wanted
# first (a call cut short keeps what it finished):
#  1. `gpu_fp8.sh prefill`: a prefill pass of the run's size (16,384 tokens of 246-token
#     prompts) by kernel, bf16 then fp8 weights and cache;
#  2. the GPU tests of what changed since the last whole-suite GPU pass: the decode grid and
#     order (test_decode.py), the rotary-and-cache kernel (test_fused_ops.py), the PDL chain,
#     the engine with CUDA graphs (greedy equality with transformers, preemption, fp8, the
#     fused Llama).
# Files back: fp8_env.txt, prefill_profile_{bf16,fp8}.{log,json}, gpu_tests.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
bash scripts/gpu_fp8.sh prefill 2>&1 | grep -vE "^(name|NVIDIA|python|commit)" | head -120
timeout "${TESTS_TIMEOUT:-330}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs \
  tests/kernels/test_decode.py tests/kernels/test_fused_ops.py tests/kernels/test_pdl.py \
  tests/engine/test_engine_gpu.py tests/engine/test_fp8.py tests/engine/test_fused_llama.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit $?"; tail -6 "$OUT/gpu_tests.log"
