#!/usr/bin/env bash
# One device call (carrying .whl, .gpu_commit and .gpu_data): the GPU tests of decode plans
# (tests/kernels/test_decode_plan.py), then the fp8/bf16 ratio at the final defaults,
# RATIO_ROUNDS (2) rounds interleaved. Files back: decode_plan_gpu_tests.log, the run JSONs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/kernels/test_decode_plan.py \
  > "$OUT/decode_plan_gpu_tests.log" 2>&1
echo "decode plan gpu tests: exit $?"; tail -3 "$OUT/decode_plan_gpu_tests.log"
RATIO_ROUNDS=${RATIO_ROUNDS:-2} bash scripts/gpu_fp8.sh ratio 2>&1 \
  | grep -vE "^(name|NVIDIA|python|commit)" | grep -E "round|median"
for f in "$OUT"/throughput_*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], round(d['output_tok_s']), d.get('triton_compiled_during_run'), {b: (round(v['gpu_ms_mean'], 3), round(v['seconds'], 2)) for b, v in d.get('decode_host_gap_by_batch', {}).items()})" "$f"
done
