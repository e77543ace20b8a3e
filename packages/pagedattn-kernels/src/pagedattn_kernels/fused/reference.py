"""Float64 references of the fused elementwise ops: exact math, no intermediate rounding; the
tests bound the ops' distance from these by the roundings each op is defined with.
"""

from __future__ import annotations

import torch

from pagedattn_kernels.cache import reference as cache_reference

__all__ = [
    "fused_add_rms_norm",
    "fused_add_rms_norm_fp8",
    "rms_norm",
    "rms_norm_fp8",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
    "silu_and_mul_fp8",
]


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


def _fp8_rows(y: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``*_fp8`` ops' definition: the float64 result rounded to the model dtype (the
    values the unfused op would store), then quantized per token by the quantization op's
    reference; shapes ``[..., width]`` and ``[..., 1]``."""
    from pagedattn_kernels.quant.reference import quantize_fp8_per_token

    rows = y.to(dtype).reshape(-1, y.shape[-1])
    q, scale = quantize_fp8_per_token(rows)
    return q.view(y.shape), scale.view(*y.shape[:-1], 1)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: :func:`rms_norm` in x's dtype, quantized per token to e4m3."""
    return _fp8_rows(rms_norm(x, weight, eps), x.dtype)


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, s)``: :func:`fused_add_rms_norm`'s norm quantized as in
    :func:`rms_norm_fp8`, and the new residual ``s`` (float64 of the dtype's sum)."""
    y, s = fused_add_rms_norm(x, residual, weight, eps)
    return (*_fp8_rows(y, x.dtype), s)


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: :func:`silu_and_mul` in x's dtype, quantized per token to e4m3."""
    return _fp8_rows(silu_and_mul(x), x.dtype)


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


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    inv_freq: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query, key)`` rotated in float64 (:func:`rotary_embedding`), returned; the caches
    get what ``reshape_and_cache``'s reference stores for the rotated keys rounded once to the
    key's dtype (the op stores keys of that dtype) and for the values."""
    q64 = rotary_embedding(positions, query, inv_freq)
    k64 = rotary_embedding(positions, key, inv_freq)
    cache_reference.reshape_and_cache(k64.to(key.dtype), value, key_cache, value_cache,
                                      slot_mapping, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    return q64, k64
