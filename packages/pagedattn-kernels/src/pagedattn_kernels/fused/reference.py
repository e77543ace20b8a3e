"""Float64 references of the fused elementwise ops: exact math, no intermediate rounding; the
tests bound the ops' distance from these by the roundings each op is defined with.
"""

from __future__ import annotations

import torch

__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, in float64."""
    x64 = x.to(torch.float64)
    rms = torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    return weight.to(torch.float64) * (x64 / rms)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s), s)`` in float64 for ``s = x + residual`` rounded to x's dtype: the new
    residual is defined as the sum the model stores (a torch add in its dtype; that rounding is
    part of the definition), the norm is exact math on it."""
    s = (x + residual).to(torch.float64)
    return rms_norm(s, weight, eps), s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gate * sigmoid(gate) * up`` for ``x = [gate, up]`` along the last dim, in float64."""
    gate, up = x.to(torch.float64).chunk(2, dim=-1)
    return gate / (1.0 + torch.exp(-gate)) * up


def rotary_embedding(
    positions: torch.Tensor, x: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """``x [T, heads, head_dim]`` rotated pair by pair, (x_i, x_{i + D/2}) by the angle
    ``positions[t] * inv_freq[i]``, in float64. The angle is the float32 product, as the models
    define it (Hugging Face computes it in float32; that rounding is part of the definition)."""
    angle = (positions[:, None].to(torch.float32) * inv_freq[None, :].to(torch.float32)).double()
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    x64 = x.to(torch.float64)
    half = x.shape[-1] // 2
    x1, x2 = x64[..., :half], x64[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
