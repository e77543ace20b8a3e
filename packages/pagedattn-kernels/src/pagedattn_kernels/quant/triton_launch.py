"""Launcher of the quantization kernel (``triton_kernels.py``).

Inputs arrive checked (``ops`` checks them). CUDA tensors get the compiled kernel, CPU tensors
the same kernel in Triton's interpreter (``pagedattn_kernels.common.kernels_for``).
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import is_interpreted, kernels_for, next_power_of_2
from pagedattn_kernels.quant.torch_impl import MIN_SCALE

KERNELS = "pagedattn_kernels.quant.triton_kernels"


def quantize_fp8_per_token(
    x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    if rows == 0:
        return out, scale_out
    if cols == 0:
        scale_out.fill_(MIN_SCALE)
        return out, scale_out
    kernel = kernels_for(x.device, KERNELS).quantize_fp8_per_token_kernel
    interpreted = is_interpreted(kernel)
    # Chunks of 16-byte loads per thread: 2048 columns with 8 warps (a 4096-wide bf16 row in
    # two steps); the interpreter takes the whole row at once.
    block = next_power_of_2(cols) if interpreted else min(2048, next_power_of_2(cols))
    kernel[(rows,)](
        x, out, scale_out, cols, x.stride(0), out.stride(0), MIN_SCALE,
        BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return out, scale_out
