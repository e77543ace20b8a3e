"""The torch path of the fused elementwise ops: the unfused compositions the Llama model runs
(``pagedkv.engine.models.layers``: Hugging Face's numerics), operation for operation, so on CPU
(and with ``backend="torch"``) each op gives exactly what the model's torch code gives. The
Triton kernels repeat these roundings step by step.

Inputs arrive checked (``ops`` checks them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face's LlamaRMSNorm, operation for operation (models/layers.py RMSNorm).
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


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
