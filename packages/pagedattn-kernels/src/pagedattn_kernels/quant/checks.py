"""Input checks of the quantization ops, run before anything is written."""

from __future__ import annotations

import torch

from pagedattn_kernels.common import FP8_DTYPE, check_float, fail


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


def check_fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                     w_scale: torch.Tensor, out: torch.Tensor | None, out_dtype: torch.dtype,
                     op: str = "fp8_matmul") -> None:  # fmt: skip
    check_float(op, "xq", xq, 2, (FP8_DTYPE,))
    check_float(op, "wq", wq, 2, (FP8_DTYPE,))
    (m, k), n = xq.shape, wq.shape[0]
    if wq.shape[1] != k:
        raise fail(op, f"xq {tuple(xq.shape)} and wq {tuple(wq.shape)} must share the inner "
                       f"dimension (wq is [out, in])")  # fmt: skip
    for name, t, rows in (("x_scale", x_scale, m), ("w_scale", w_scale, n)):
        check_float(op, name, t, t.dim() if isinstance(t, torch.Tensor) else 1,
                    (torch.float32,))  # fmt: skip
        if t.numel() != rows or t.dim() > 2 or (t.dim() == 2 and 1 not in t.shape):
            raise fail(op, f"{name} must hold one float32 scale per row of "
                           f"{'xq' if name == 'x_scale' else 'wq'} ({rows}), got shape "
                           f"{tuple(t.shape)}")  # fmt: skip
    for name, t in (("x_scale", x_scale), ("w_scale", w_scale), ("wq", wq)):
        if t.device != xq.device:
            raise fail(op, f"{name} is on {t.device}, xq on {xq.device}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise fail(op, f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (m, n)
        or out.dtype != out_dtype
        or out.device != xq.device
        or (n > 1 and out.stride(1) != 1)
    ):
        raise fail(op, f"out must be a {out_dtype} tensor of shape ({m}, {n}) on {xq.device} "
                       f"with contiguous rows")  # fmt: skip


def check_matmul_16bit(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None,
                       op: str = "matmul_16bit") -> None:  # fmt: skip
    check_float(op, "x", x, 2, (torch.bfloat16, torch.float16))
    check_float(op, "w", w, 2, (x.dtype,))
    (m, k), n = x.shape, w.shape[0]
    if w.shape[1] != k:
        raise fail(op, f"x {tuple(x.shape)} and w {tuple(w.shape)} must share the inner "
                       f"dimension (w is [out, in])")  # fmt: skip
    if w.device != x.device:
        raise fail(op, f"w is on {w.device}, x on {x.device}")
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (m, n)
        or out.dtype != x.dtype
        or out.device != x.device
        or (n > 1 and out.stride(1) != 1)
    ):
        raise fail(op, f"out must be a {x.dtype} tensor of shape ({m}, {n}) on {x.device} "
                       f"with contiguous rows")  # fmt: skip


def check_gate_up(op: str, w: torch.Tensor) -> None:
    """A fused gate/up projection's weight: its rows are the gate's, then as many of the up's."""
    if w.shape[0] % 2:
        raise fail(op, f"the weight must stack the gate's and the up projection's rows (an even "
                       f"number), got {w.shape[0]} rows")  # fmt: skip
