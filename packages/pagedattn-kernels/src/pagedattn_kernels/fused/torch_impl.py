"""The torch path of the fused elementwise ops: the unfused compositions the Llama model runs
(``pagedkv.engine.models.layers``: Hugging Face's numerics), operation for operation, so on CPU
(and with ``backend="torch"``) each op gives exactly what the model's torch code gives. The
Triton kernels repeat these roundings step by step.

Inputs arrive checked (``ops`` checks them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedattn_kernels.cache import torch_impl as cache
from pagedattn_kernels.common import FP8_DTYPE
from pagedattn_kernels.quant import torch_impl as quant


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face's LlamaRMSNorm, operation for operation (models/layers.py RMSNorm).
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def to_fp8_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y [..., width]`` quantized per token (the quantization op's torch path): the ``*_fp8``
    ops unfused, ``(q [..., width] e4m3, scale [..., 1] float32)``."""
    width = y.shape[-1]
    rows = y.reshape(-1, width)
    q = torch.empty(rows.shape, dtype=FP8_DTYPE, device=y.device)
    scale = torch.empty((rows.shape[0], 1), dtype=torch.float32, device=y.device)
    quant.quantize_fp8_per_token(rows, q, scale)
    return q.view(y.shape), scale.view(*y.shape[:-1], 1)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return to_fp8_rows(_rms_norm(x, weight, eps))


def fused_add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, s = fused_add_rms_norm(x, residual, weight, eps, None, residual_out)
    return (*to_fp8_rows(y), s)


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return to_fp8_rows(silu_and_mul(x, None))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None
) -> torch.Tensor:
    y = _rms_norm(x, weight, eps)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    y = _rms_norm(s, weight, eps)
    if residual_out is not None:
        residual_out.copy_(s)
        s = residual_out
    if out is not None:
        out.copy_(y)
        y = out
    return y, s


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    inter = x.shape[-1] // 2
    y = F.silu(x[..., :inter]) * x[..., inter:]
    if out is None:
        return y
    out.copy_(y)
    return out


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, inv_freq: torch.Tensor
) -> None:
    # RotaryEmbedding.cos_sin + apply_rotary (models/layers.py), written back in place.
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(query.dtype)[:, None, :]
    sin = emb.sin().to(query.dtype)[:, None, :]
    for x in (query, key):
        if x is not None:
            x.copy_(x * cos + _rotate_half(x) * sin)


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    inv_freq: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    # The two ops one after the other: what the Triton kernel does in one pass.
    rotary_embedding(positions, query, key, inv_freq)
    cache.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
