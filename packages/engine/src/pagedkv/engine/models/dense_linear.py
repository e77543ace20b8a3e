"""The 16-bit (unquantized) linear layers' matmul: cuBLAS, or for decode batches the kernel
that streams the weights.

A bf16 decode step of a few sequences is mostly weight reads: at 1-64 sequences Llama-3-8B's
four linear layers are ~78% of the step on an H200. At 1-32 rows cuBLAS's kernels read the
weights of Q/K/V and the output projection at 59-78% of the copy bandwidth, and split the
output projection's K with a second kernel (``scripts/bf16_stream_gemm.py``).
``pagedattn_kernels.matmul_16bit`` puts the weight rows on the tensor-core tile's long side
and the few tokens on its short side (the kernel of ``fp8_matmul``, without scales) and merges
split K in place: the four matmuls of a layer took 113-117 us against cuBLAS's 118-124 at 1-32
rows, and lost from 48 rows (9b846dc). So :func:`dense_linear` sends matmuls of at most
``MATMUL_16BIT_MAX_ROWS`` (32) rows of bf16 or fp16 to it on GPUs of compute capability 9.0
(Hopper, where it was measured), and everything else to ``F.linear``. The sums are float32 in
both, in another order: the outputs may differ in the last bit of bf16.

``PAGEDKV_MATMUL_16BIT_MAX_ROWS`` sets the row limit for a run (0: ``F.linear`` always).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pagedattn_kernels
from pagedkv.engine.models.quantization import cuda_capability, row_limit

MATMUL_16BIT_MAX_ROWS = row_limit("PAGEDKV_MATMUL_16BIT_MAX_ROWS", "32")
MATMUL_16BIT_DTYPES = (torch.bfloat16, torch.float16)


def takes_matmul_16bit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`dense_linear` sends ``x [..., in]`` to ``pagedattn_kernels.matmul_16bit``:
    1 to ``MATMUL_16BIT_MAX_ROWS`` rows of a 16-bit dtype that ``weight`` shares, on a Hopper
    GPU."""
    if not x.is_cuda or x.dtype not in MATMUL_16BIT_DTYPES or weight.dtype != x.dtype:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    if not 0 < rows <= MATMUL_16BIT_MAX_ROWS:
        return False
    return cuda_capability(x.device) >= (9, 0)


def dense_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)``, by ``pagedattn_kernels.matmul_16bit`` for decode batches
    (:func:`takes_matmul_16bit`; the bias added after)."""
    if not takes_matmul_16bit(x, weight):
        return F.linear(x, weight, bias)
    y = pagedattn_kernels.matmul_16bit(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dense_linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU's activation of :func:`dense_linear`'s output for a fused gate/up ``weight [2 I,
    in]`` (no bias): ``silu(gate) * up`` in one kernel with the matmul
    (``pagedattn_kernels.matmul_16bit_silu_and_mul``) where :func:`dense_linear` would take
    ``matmul_16bit``; else None, for the caller to run the two ops. On an H200 a bf16
    Llama-3-8B decode step took 4.63 against 4.67 ms at 8 sequences and 5.50 against 5.59 at
    32, and the real-ShareGPT run gained 0.25% (e47b26b / 65c42c0, ``scripts/gpu_fp8.sh
    stepab`` and ``envab``)."""
    if not takes_matmul_16bit(x, weight):
        return None
    y = pagedattn_kernels.matmul_16bit_silu_and_mul(x.reshape(-1, x.shape[-1]), weight)
    return y.reshape(*x.shape[:-1], weight.shape[0] // 2)
