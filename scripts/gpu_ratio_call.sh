#!/usr/bin/env bash
# One device call (carrying .whl, .gpu_commit and .gpu_data): the GPU tests of
# pagedattn_kernels.argmax_rows (the engine's greedy tokens; off for the runs below if they
# fail), the greedy argmax bench with it, then the fp8/bf16 ratio at this commit's defaults,
# RATIO_ROUNDS (2) rounds interleaved. Files back: argmax_gpu_tests.log, greedy_argmax.json,
# the run JSONs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
timeout 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs tests/kernels/test_argmax_rows.py \
  > "$OUT/argmax_gpu_tests.log" 2>&1
rc=$?; echo "argmax_rows gpu tests: exit $rc"; tail -3 "$OUT/argmax_gpu_tests.log"
if [[ $rc != 0 ]]; then export PAGEDKV_ARGMAX_KERNEL=0; echo "argmax_rows off for the runs"; fi
timeout 120 "$PY" scripts/greedy_argmax_bench.py --rounds 2 --output-json "$OUT/greedy_argmax.json" 2>&1 | tail -9
RATIO_ROUNDS=${RATIO_ROUNDS:-2} bash scripts/gpu_fp8.sh ratio 2>&1 \
  | grep -vE "^(name|NVIDIA|python|commit)" | grep -E "round|median"
for f in "$OUT"/throughput_*.json; do
  "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], round(d['output_tok_s']), d.get('triton_compiled_during_run'), 'mixed', round(d['mixed_seconds'], 2), {b: (round(v['gpu_ms_mean'], 3), round(v['seconds'], 2)) for b, v in d.get('decode_host_gap_by_batch', {}).items()})" "$f"
done
