# Sourced (not run) by the GPU scripts, from the repository root: the environment every run on
# the GPU machine needs. Once per shell tree: a script that calls another does the work once.
#  - the wheels the machine lacks, carried in .whl, installed to /tmp/site (SKIP_WHEELS=1: none);
#  - this checkout's packages on PYTHONPATH (nothing is pip-installed there);
#  - NVLink multicast off in NCCL, PyTorch and NVSHMEM, as that machine requires;
#  - PAGEDKV_COMMIT from a carried .gpu_commit (the machine's copy of .git is stale).
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PAGEDKV_COMMIT="${PAGEDKV_COMMIT:-$(cat .gpu_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)}"
if [[ -z "${PAGEDKV_GPU_ENV:-}" ]]; then
  if [[ "${SKIP_WHEELS:-0}" != 1 ]] && ls .whl/*.whl >/dev/null 2>&1; then
    "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl || return 1
  fi
  _src=""
  for _p in kvblocks pagedattn-kernels scheduler engine server bench; do _src="$_src:$PWD/packages/$_p/src"; done
  export PYTHONPATH="/tmp/site$_src${PYTHONPATH:+:$PYTHONPATH}"
  export PAGEDKV_GPU_ENV=1
  unset _src _p
fi
