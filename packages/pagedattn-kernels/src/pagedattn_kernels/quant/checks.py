"""Input checks of the quantization ops, run before anything is written."""

from __future__ import annotations

import torch

from pagedattn_kernels.common import check_float, fail


def check_quantize_fp8_per_token(x: torch.Tensor, out: torch.Tensor | None,
                                 scale_out: torch.Tensor | None) -> None:  # fmt: skip
    op = "quantize_fp8_per_token"
    check_float(op, "x", x, 2)
    rows = x.shape[0]
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or out.shape != x.shape
        or out.dtype != torch.float8_e4m3fn
        or out.device != x.device
        or not out.is_contiguous()
    ):
        raise fail(op, f"out must be a contiguous float8_e4m3fn tensor of x's shape "
                       f"{tuple(x.shape)} on {x.device}")  # fmt: skip
    if scale_out is not None and (
        not isinstance(scale_out, torch.Tensor)
        or tuple(scale_out.shape) != (rows, 1)
        or scale_out.dtype != torch.float32
        or scale_out.device != x.device
        or not scale_out.is_contiguous()
    ):
        raise fail(op, f"scale_out must be a contiguous float32 tensor of shape ({rows}, 1) "
                       f"on {x.device}")  # fmt: skip
