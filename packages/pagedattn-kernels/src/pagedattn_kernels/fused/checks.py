"""Input checks of the fused elementwise ops (both backends), run before anything is written."""

from __future__ import annotations

import math
import numbers

import torch

from pagedattn_kernels.common import FLOAT_DTYPES, INDEX_DTYPES, fail, next_power_of_2
from pagedattn_kernels.fused.triton_launch import MAX_HIDDEN, MAX_ROTARY_TILE, row_view


def check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise fail(op, f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_norm(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] == 0:
        raise fail(op, "x must be a tensor [..., hidden] with hidden > 0")
    check_dtype(op, "x", x)
    hidden = x.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.shape != (hidden,):
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise fail(op, f"weight must have shape ({hidden},) like x's last dim, got {got}")
    if weight.dtype != x.dtype:
        raise fail(op, f"weight is {weight.dtype} but x is {x.dtype}; cast the weight")
    if weight.device != x.device:
        raise fail(op, f"weight is on {weight.device} but x is on {x.device}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
            got = tuple(residual.shape) if isinstance(residual, torch.Tensor) else residual
            raise fail(op, f"residual must have x's shape {tuple(x.shape)}, got {got}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise fail(
                op,
                f"residual is {residual.dtype} on {residual.device}, x {x.dtype} on "
                f"{x.device}: they must match",
            )
    if (
        isinstance(eps, bool)
        or not isinstance(eps, numbers.Real)
        or not math.isfinite(eps)
        or eps < 0
    ):
        raise fail(op, f"eps must be a finite number >= 0, got {eps!r}")
    return hidden


def check_out(
    op: str, name: str, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> None:
    """``out``: None, or a tensor the kernels can write row by row."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise fail(op, f"{name} must have shape {tuple(shape)}, got {got}")
    if out.dtype != like.dtype or out.device != like.device:
        raise fail(
            op, f"{name} is {out.dtype} on {out.device}; it must be {like.dtype} on {like.device}"
        )
    if row_view(out, shape[-1]) is None:
        raise fail(
            op,
            f"{name} needs stride 1 in its last dim and rows one stride apart "
            f"(got strides {out.stride()}); pass a contiguous tensor",
        )


def check_silu_and_mul(op: str, x: torch.Tensor, out: torch.Tensor | None) -> int:
    """Returns the intermediate size (half of x's last dim)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise fail(op, "x must be a tensor [..., 2 * intermediate]")
    check_dtype(op, "x", x)
    width = x.shape[-1]
    if width == 0 or width % 2:
        raise fail(op, f"x's last dim must be 2 * intermediate > 0 (gate, up), got {width}")
    inter = width // 2
    check_out(op, "out", out, (*x.shape[:-1], inter), x)
    return inter


def check_triton_norm(op: str, hidden: int) -> None:
    if hidden > MAX_HIDDEN:
        raise fail(op, f"the Triton kernel takes hidden sizes up to {MAX_HIDDEN}, got {hidden}; "
                       "use backend='torch'")  # fmt: skip


def check_rotary(
    op: str,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    inv_freq: torch.Tensor,
) -> int:
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise fail(op, f"query must be [num_tokens, num_heads, head_dim], got {got}")
    check_dtype(op, "query", query)
    num_tokens, _, head_dim = query.shape
    if head_dim == 0 or head_dim % 2:
        raise fail(op, f"head_dim must be even and > 0, got {head_dim}")
    if not isinstance(positions, torch.Tensor) or positions.shape != (num_tokens,):
        got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
        raise fail(op, f"positions must have shape ({num_tokens},), got {got}")
    if positions.dtype not in INDEX_DTYPES:
        raise fail(op, f"positions must be int32 or int64, got {positions.dtype}")
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.shape != (head_dim // 2,):
        got = tuple(inv_freq.shape) if isinstance(inv_freq, torch.Tensor) else inv_freq
        raise fail(op, f"inv_freq must have shape ({head_dim // 2},) (head_dim / 2), got {got}")
    if inv_freq.dtype != torch.float32:
        raise fail(op, f"inv_freq must be float32 (as the model keeps it), got {inv_freq.dtype}")
    tensors = {"positions": positions, "inv_freq": inv_freq, "query": query}
    if key is not None:
        if not isinstance(key, torch.Tensor) or key.dim() != 3:
            got = tuple(key.shape) if isinstance(key, torch.Tensor) else type(key).__name__
            raise fail(op, f"key must be [num_tokens, num_kv_heads, head_dim] or None, got {got}")
        if key.shape[0] != num_tokens or key.shape[2] != head_dim:
            raise fail(
                op, f"key {tuple(key.shape)} and query {tuple(query.shape)} must share tokens "
                "and head_dim"
            )  # fmt: skip
        if key.dtype != query.dtype:
            raise fail(op, f"key is {key.dtype} but query is {query.dtype}")
        if key.numel() and query.numel() and key.data_ptr() == query.data_ptr():
            raise fail(op, "query and key must be different tensors")
        tensors["key"] = key
    for name, t in tensors.items():
        if t.device != query.device:
            raise fail(op, f"{name} is on {t.device} but query is on {query.device}")
    for name, t in (("query", query), ("key", key)):
        if t is not None and t.stride(-1) != 1 and t.shape[-1] > 1:
            raise fail(op, f"{name} is rotated in place and needs stride 1 in its last dim")
    return head_dim


def check_triton_rotary(op: str, query: torch.Tensor, key: torch.Tensor | None) -> None:
    heads = max(query.shape[1], key.shape[1] if key is not None else 0)
    head_dim = query.shape[2]
    if next_power_of_2(heads) * next_power_of_2(head_dim // 2) > MAX_ROTARY_TILE:
        raise fail(op, f"{heads} heads x head dim {head_dim} is too large for the Triton "
                       "kernel; use backend='torch'")  # fmt: skip


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.data_ptr() == b.data_ptr()
