"""Float64-exact references of the quantization ops, written for obviousness: the scale from the
row's largest magnitude, then each element to its nearest e4m3 value by search over the codes
(``pagedattn_kernels.cache.reference.nearest_e4m3``), no cast involved; the fp8 matmul as the
float64 product of the dequantized operands; the 16-bit matmul as the float64 product; each
with SwiGLU's activation as ``silu(gate) * up`` of that float64 product."""

from __future__ import annotations

import torch

from pagedattn_kernels.cache.reference import nearest_e4m3

__all__ = [
    "fp8_matmul",
    "fp8_matmul_silu_and_mul",
    "matmul_16bit",
    "matmul_16bit_silu_and_mul",
    "quantize_fp8_per_token",
]

_FP8_MAX = 448.0
_MIN_SCALE = 1.0 / (448.0 * 512.0)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[rows, cols]`` float8_e4m3fn, ``[rows, 1]`` float32 scales), one row at a time."""
    rows = []
    scales = []
    for row in x:
        amax = float(row.to(torch.float64).abs().max()) if row.numel() else 0.0
        # The kernels divide in float32: amax is exact there, so is 448, the quotient rounds.
        scale = torch.tensor(amax, dtype=torch.float32) / torch.tensor(_FP8_MAX)
        scale = torch.maximum(scale, torch.tensor(_MIN_SCALE, dtype=torch.float32))
        scales.append(scale.reshape(1))
        rows.append(nearest_e4m3(row, scale))
    if not rows:
        return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty((0, 1), dtype=torch.float32, device=x.device))  # fmt: skip
    return torch.stack(rows), torch.stack(scales).to(x.device)


def fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
               w_scale: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """float64 ``(xq * x_scale) @ (wq * w_scale.T).T``: what the kernels compute, before
    their float32 sums and the output's rounding."""
    x = xq.to(torch.float64) * x_scale.reshape(-1, 1).to(torch.float64)
    w = wq.to(torch.float64) * w_scale.reshape(-1, 1).to(torch.float64)
    return x @ w.T


def matmul_16bit(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 ``x @ w.T``: what the kernels compute, before their float32 sums and the
    output's rounding."""
    return x.to(torch.float64) @ w.to(torch.float64).T


def fp8_matmul_silu_and_mul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                            w_scale: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """float64 ``silu(y[:, :I]) * y[:, I:]`` of :func:`fp8_matmul`'s ``y`` (``wq [2 I, K]``):
    before the kernels' roundings (the projection's, the activation's two) and, for their
    ``fp8_out``, before the per-token quantization (:func:`quantize_fp8_per_token`)."""
    from pagedattn_kernels.fused.reference import silu_and_mul  # it imports this module

    return silu_and_mul(fp8_matmul(xq, x_scale, wq, w_scale))


def matmul_16bit_silu_and_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 ``silu(y[:, :I]) * y[:, I:]`` of :func:`matmul_16bit`'s ``y``."""
    from pagedattn_kernels.fused.reference import silu_and_mul

    return silu_and_mul(matmul_16bit(x, w))
