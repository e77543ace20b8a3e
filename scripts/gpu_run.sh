#!/usr/bin/env bash
# One call on the GPU machine (NVIDIA H200, torch 2.11, triton 3.6, no network): put the carried
# wheels and this checkout's packages on the path, run every `gpu` test, then the benchmarks.
# Logs and JSON results go under $OUT. Run from the repository root:
#   bash scripts/gpu_run.sh [tests|kernels|engine|all]
set -uo pipefail
OUT="${OUT:-/tmp/pagedkv-gpu-out}"
mkdir -p "$OUT"
what="${1:-all}"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, transformers, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  echo "commit $PAGEDKV_COMMIT"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ "$what" == all || "$what" == tests || "$what" == kernel-tests ]]; then
  # 377 tests: about 6 minutes on an H200 (2026-12-02; 338 of them in 330 s), so a call of
  # its own
  timeout 560 python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider -rs \
    2>&1 | tee "$OUT/kernel_gpu_tests.log" | tail -8
fi
if [[ "$what" == all || "$what" == tests || "$what" == engine ]]; then
  # The embedded GGUF (98 MB) travels only in parts (scripts/gpu_notebooks.sh receive): its
  # tests are deselected here, and the engine's GPU tests use a synthetic checkpoint instead
  # (see test_engine_gpu.py). Carry .whl: some engine tests import gguf and jsonschema.
  timeout 420 python3 -m pytest -m gpu tests/engine -k "not embedded" -q -p no:cacheprovider -rs \
    --durations=10 2>&1 | tee "$OUT/engine_gpu_tests.log" | tail -40
fi
if [[ "$what" == all || "$what" == kernels ]]; then
  timeout 300 python3 -m pagedkv.bench.kernels 2>&1 | tee "$OUT/kernels_bench.log" | tail -40
fi
