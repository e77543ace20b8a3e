"""The quantization op: per-token (per-row) dynamic fp8 quantization of activations.

It checks its inputs (``checks``), then runs the implementation that fits the tensors' device
(``pagedattn_kernels.common.resolve_backend``): the Triton kernel (``triton_launch``,
``triton_kernels``) or the torch path (``torch_impl``). ``reference`` holds the exact
definition it is tested against. Public through ``pagedattn_kernels.ops``.
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import FP8_DTYPE, check_fp8_triton, resolve_backend
from pagedattn_kernels.quant import torch_impl, triton_launch
from pagedattn_kernels.quant.checks import check_quantize_fp8_per_token

__all__ = ["quantize_fp8_per_token"]


def quantize_fp8_per_token(
    x: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x [rows, cols]`` (a float dtype, unit stride on the columns) to e4m3 with
    its own scale: ``scale = max(amax(|row|) / 448, 1 / (448 * 512))`` (float32) and
    ``q = e4m3(clamp(row / scale, -448, 448))``, rounded to nearest even, so that
    ``q * scale`` approximates the row. Returns ``(q [rows, cols] float8_e4m3fn, scale [rows,
    1] float32)``, written into ``out`` / ``scale_out`` when given. This is the activation
    side of ``torch._scaled_mm`` with row-wise scales."""
    check_quantize_fp8_per_token(x, out, scale_out)
    if out is None:
        out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if scale_out is None:
        scale_out = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if resolve_backend(x.device, backend) == "torch":
        return torch_impl.quantize_fp8_per_token(x, out, scale_out)
    check_fp8_triton("quantize_fp8_per_token", x.device)
    x = x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()
    return triton_launch.quantize_fp8_per_token(x, out, scale_out)
