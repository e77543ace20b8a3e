"""The torch path of the quantization ops (the CPU path, and a fallback anywhere).

Inputs arrive checked (``ops`` checks them).
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import FP8_DTYPE, FP8_MAX

# Smallest scale: an all-zero row gets this instead of 0 (no division by zero), and no row's
# scale is so small that x / scale loses its low bits to subnormals (vLLM's floor).
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_fp8_per_token(
    x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale = max(amax(|row|) / 448, MIN_SCALE)`` in float32, ``out = e4m3(clamp(row /
    scale, -448, 448))``."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True) if x.shape[1] else xf.new_zeros(x.shape[0], 1)
    # A tensor divisor: PyTorch's CUDA kernels multiply by the reciprocal of a Python scalar,
    # one rounding more than the true quotient the Triton kernel and the reference take.
    fp8_max = torch.full((1, 1), FP8_MAX, dtype=torch.float32, device=x.device)
    torch.clamp(amax / fp8_max, min=MIN_SCALE, out=scale_out)
    out.copy_((xf / scale_out).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
    return out, scale_out


def fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
               w_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``(xq @ wq.T) * x_scale * w_scale.T`` in float32 (e4m3 values and their products are
    exact there), then ``out``'s dtype."""
    y = xq.to(torch.float32) @ wq.to(torch.float32).T
    y = y * x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    return out.copy_(y)


def matmul_16bit(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` by torch's matmul (cuBLAS on a GPU, float32 sums), into ``out``."""
    return torch.mm(x, w.T, out=out)


def _silu_and_mul(y: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul``'s torch path on a projection ``y [M, 2 I]``."""
    from pagedattn_kernels.fused.torch_impl import silu_and_mul  # it imports this module

    return silu_and_mul(y, None)


def fp8_matmul_silu_and_mul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                            w_scale: torch.Tensor, out_dtype: torch.dtype,
                            fp8_out: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`fp8_matmul` into ``out_dtype``, its activation, and with ``fp8_out`` that
    quantized per token: the three ops one after the other."""
    y = torch.empty((xq.shape[0], wq.shape[0]), dtype=out_dtype, device=xq.device)
    a = _silu_and_mul(fp8_matmul(xq, x_scale, wq, w_scale, y))
    if not fp8_out:
        return a
    q = torch.empty(a.shape, dtype=FP8_DTYPE, device=a.device)
    scale = torch.empty((a.shape[0], 1), dtype=torch.float32, device=a.device)
    return quantize_fp8_per_token(a, q, scale)


def matmul_16bit_silu_and_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`matmul_16bit`, then its activation."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    return _silu_and_mul(matmul_16bit(x, w, y))
