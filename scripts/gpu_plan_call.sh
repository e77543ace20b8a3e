#!/usr/bin/env bash
# One device call (run from the repository root, carrying .whl, .gpu_commit and .gpu_data),
# most wanted first (a call cut short keeps what it finished):
#  1. the fp8 run then the bf16 run with decode plans (the engine's default), the compiled
#     kernels named (`gpu_fp8.sh ratio`, RATIO_ROUNDS rounds, default 1);
#  2. decode attention by plans at the large batches where the fp8 crossover is (padded as
#     the graphs stage them, and exact), both caches;
#  3. the engine's GPU tests with plans: greedy equality with transformers, preemption, fp8,
#     the graph inputs.
# Files back: the run JSONs, decode_plans.{json,log}, gpu_tests.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
RATIO_ROUNDS=${RATIO_ROUNDS:-1} bash scripts/gpu_fp8.sh ratio 2>&1 \
  | grep -vE "^(name|NVIDIA|python|commit)" | tail -12
for f in "$OUT"/throughput_*.json; do
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], round(d['output_tok_s']), d.get('triton_compiled_during_run'), {b: round(v['seconds'], 2) for b, v in d.get('decode_host_gap_by_batch', {}).items()})" "$f"
done
PLAN_SHAPES=${PLAN_SHAPES:-384x0,512x0,640x0,768x0,1024x0} PLAN_CHUNKS=${PLAN_CHUNKS:-128,128e} \
  PLAN_TILE_SHAPES='' bash scripts/gpu_fp8.sh plans 2>&1 | grep -E "^B=|ok:" | tail -40
timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider -rs \
  tests/engine/test_engine_gpu.py tests/engine/test_fp8.py tests/engine/test_runner_graph_inputs.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit $?"; tail -6 "$OUT/gpu_tests.log"
