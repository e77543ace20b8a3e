#!/usr/bin/env bash
# One device call (carrying .whl and .gpu_commit): Nsight Compute on the kernels of a small fp8
# decode step (scripts/ncu_small_decode.py): decode attention (fp8 and bf16 caches, a decode
# plan), the four fp8 matmuls and the fused add + RMS norm, at NCU_BATCHES (16,64) rows: launch
# statistics, occupancy, speed of light, warp stalls, scheduler and memory sections, the top
# stall sites. First the kernels' times without ncu. Files back: ncu_<batch>.log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh || exit 1
OUT="${OUT:-/tmp/pagedkv-gpu-out}"; mkdir -p "$OUT"
PY="${PYTHON:-python3}"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-missing}"
for b in ${NCU_BATCHES:-16 64}; do
  echo "=== times at $b rows (no ncu)"
  timeout 120 "$PY" scripts/ncu_small_decode.py --batch "$b" --bf16-attention 2>&1 | grep " us$"
done
[[ -z "$NCU" ]] && exit 1
for b in ${NCU_BATCHES:-16 64}; do
  echo "=== ncu at $b rows"
  NCU=1 timeout 240 "$NCU" --clock-control none -k "regex:${NCU_KERNELS:-decode_kernel|decode_merge_kernel|fp8_matmul_kernel|rms_norm_kernel}" \
    --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    "$PY" scripts/ncu_small_decode.py --batch "$b" --bf16-attention > "$OUT/ncu_$b.log" 2>&1
  echo "    exit $?"
  grep -E "^  [a-z_]+.*\(|Duration|Achieved Occupancy|Registers Per|Block Limit|Memory Throughput|DRAM Throughput|Warp Cycles Per Issued|Issued Warp Per" "$OUT/ncu_$b.log" | head -120
done
