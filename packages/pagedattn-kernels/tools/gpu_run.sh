#!/usr/bin/env bash
# One call on the GPU machine: the gpu-marked kernel tests, then the benchmark.
# Logs go to $OUT (the device tool's output folder). Usage, from the repo root:
#   bash packages/pagedattn-kernels/tools/gpu_run.sh <commit>
set -uo pipefail
cd "$(dirname "$0")/../../.."
# the benchmark is pagedkv-bench's (pagedkv.bench.kernels)
export PYTHONPATH="$PWD/packages/pagedattn-kernels/src:$PWD/packages/bench/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT="${OUT:-/tmp/pagedattn-gpu}"
mkdir -p "$OUT"
COMMIT="${1:-unknown}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv \
  | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/kernels -m gpu -q -n 8 \
  --maxfail=10 --timeout=150 -p no:cacheprovider --durations=10 2>&1 | tee "$OUT/tests.log"
echo "pytest exit: ${PIPESTATUS[0]}"
timeout "${BENCH_TIMEOUT:-220}" python3 -m pagedkv.bench.kernels --commit "$COMMIT" \
  --budget-s "${BENCH_BUDGET:-150}" 2>&1 | tee "$OUT/bench.log"
echo "bench exit: ${PIPESTATUS[0]}"
