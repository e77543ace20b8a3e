"""Launcher of the quantization kernel (``triton_kernels.py``).

Inputs arrive checked (``ops`` checks them). CUDA tensors get the compiled kernel, CPU tensors
the same kernel in Triton's interpreter (``pagedattn_kernels.common.kernels_for``).
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import e4m3_encoder, kernels_for, next_power_of_2
from pagedattn_kernels.quant.torch_impl import MIN_SCALE

KERNELS = "pagedattn_kernels.quant.triton_kernels"
ONE_PASS_COLS = 16384


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
    # One pass over rows up to ONE_PASS_COLS wide, held in registers (16 warps: at most 32
    # float32 values per thread); longer rows in chunks of 2048 columns, read twice.
    whole = next_power_of_2(cols)
    one_pass = whole <= ONE_PASS_COLS
    block = whole if one_pass else 2048
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    kernel[(rows,)](
        x, out, scale_out, cols, x.stride(0), out.stride(0), MIN_SCALE,
        BLOCK=block, ONE_PASS=one_pass, E4M3=e4m3_encoder(kernel, x.device), num_warps=warps,
    )  # fmt: skip
    return out, scale_out
