"""Fused elementwise ops of a decoder layer: RMSNorm (alone, or with the residual add fused in),
SiLU-and-multiply, rotary embedding.

Unfused, each is a chain of small torch kernels that every one reads and writes the whole
activation (RMSNorm alone is eight: add, cast, square, mean, add, rsqrt, multiply, cast,
multiply), which at decode batch sizes costs more in launches and memory traffic than the
arithmetic. Fused, each is one kernel that reads its inputs once and writes its outputs once.

Numerics: each op reproduces the rounding sequence of the torch composition the Llama model
runs unfused (``pagedkv.engine.models.layers``: Hugging Face's), see each op's docstring for
how exactly. The backend follows the tensors' device like every op here (CUDA -> Triton, CPU
-> torch, ``backend=`` or ``PAGEDATTN_BACKEND`` to force one; ``triton`` on CPU tensors runs
the kernels in Triton's interpreter). The torch path *is* the unfused composition.

In place: ``rms_norm`` and ``fused_add_rms_norm`` write where ``out`` / ``residual_out`` say
(new tensors when None); passing ``out=x, residual_out=residual`` updates the caller's
tensors in place (vLLM's convention) without allocating. ``rotary_embedding`` always rotates
``query`` and ``key`` in place. Nothing here reads a value on the host, allocates an amount
that depends on values, or syncs the device, so every op can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
import torch.nn.functional as F

from pagedattn_kernels.backend import kernels_for, resolve_backend
from pagedattn_kernels.validation import FLOAT_DTYPES, INDEX_DTYPES, fail

#: Widest row the Triton RMSNorm takes (one program holds a whole row in registers).
MAX_HIDDEN = 32768
#: Largest ``heads x head_dim / 2`` tile the Triton rotary kernel takes per token.
MAX_ROTARY_TILE = 32768

_ROUND_NONE, _ROUND_CAST, _ROUND_BF16_BITS = 0, 1, 2  # fused_kernels.ROUND_*
# Interpreted launches pay per operation, not per element: few programs with big tiles.
_INTERPRETER_TILE = 1 << 16


# --------------------------------------------------------------------------- public ops


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``weight * (h * rsqrt(mean(h^2, -1) + eps)).to(x.dtype)`` with ``h = x.float()``:
    Hugging Face's LlamaRMSNorm over the last dim of ``x [..., hidden]``.

    ``weight [hidden]`` has x's dtype. Returns ``out`` (a new tensor when None; ``out=x``
    normalizes in place). ``out`` needs stride 1 in its last dim and rows that one stride
    reaches (e.g. any contiguous tensor or a row slice of one); ``x`` may have any strides.

    Exactness of the Triton kernel against that torch composition on the same GPU: every
    rounding to the dtype happens at the same point, but the sum of squares is added up in
    another order, so ``rsqrt`` may differ in its last fp32 bit: results are equal in all but
    a rare element (where they differ by 1 ulp of bfloat16/float16), and within a few fp32
    ulps for float32.
    """
    op = "rms_norm"
    hidden = _check_norm(op, x, None, weight, eps)
    _check_out(op, "out", out, x.shape, x)
    if resolve_backend(x.device, backend) == "torch":
        y = _torch_rms_norm(x, weight, eps)
        if out is None:
            return y
        out.copy_(y)
        return out
    _check_triton_norm(op, hidden)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(
        out, None, _read_rows(x, hidden), None, weight.contiguous(), float(eps), hidden
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm residual step of a decoder layer in one pass.

    Returns ``(normed, new_residual)`` where ``new_residual = x + residual`` (rounded to the
    dtype, as torch adds) and ``normed = rms_norm(new_residual, weight, eps)``: what
    ``h = residual + h; h = norm(h)`` computes in Hugging Face's Llama. ``x``, ``residual``
    ``[..., hidden]`` and ``weight [hidden]`` share one dtype. Results go to ``out`` and
    ``residual_out`` (new tensors when None): ``out=x, residual_out=residual`` is the
    allocation-free in-place form (vLLM's ``fused_add_rms_norm``). ``out`` and
    ``residual_out`` must be different tensors; each needs stride 1 in its last dim.

    Exactness of the Triton kernel against the torch composition on the same GPU:
    ``new_residual`` is bit-identical; ``normed`` as in :func:`rms_norm`.
    """
    op = "fused_add_rms_norm"
    hidden = _check_norm(op, x, residual, weight, eps)
    _check_out(op, "out", out, x.shape, x)
    _check_out(op, "residual_out", residual_out, x.shape, x)
    if out is not None and residual_out is not None and _same_memory(out, residual_out):
        raise fail(op, "out and residual_out must be different tensors")
    if resolve_backend(x.device, backend) == "torch":
        s = x + residual
        y = _torch_rms_norm(s, weight, eps)
        if residual_out is not None:
            residual_out.copy_(s)
            s = residual_out
        if out is not None:
            out.copy_(y)
            y = out
        return y, s
    _check_triton_norm(op, hidden)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(
        out, residual_out, _read_rows(x, hidden), _read_rows(residual, hidden),
        weight.contiguous(), float(eps), hidden,
    )  # fmt: skip
    return out, residual_out


def silu_and_mul(
    x: torch.Tensor, *, out: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2 * I]`` (a fused gate/up projection's
    output): the SwiGLU activation, ``F.silu(gate) * up``. Returns ``out [..., I]`` (a new
    tensor when None; it needs stride 1 in its last dim).

    Exactness of the Triton kernel against ``F.silu(gate) * up`` on the same GPU: the same
    formula (``g / (1 + expf(-g))`` in fp32, libdevice's ``expf``, IEEE division) rounded to
    the dtype at the same two points, so bit-identical as far as libdevice's ``expf`` and the
    one torch was built with agree (both are the CUDA math library's). Under Triton's
    interpreter numpy's ``exp`` replaces ``expf``: equal to the CPU torch result but for a
    rare 1-ulp difference.
    """
    op = "silu_and_mul"
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise fail(op, "x must be a tensor [..., 2 * intermediate]")
    _check_dtype(op, "x", x)
    width = x.shape[-1]
    if width == 0 or width % 2:
        raise fail(op, f"x's last dim must be 2 * intermediate > 0 (gate, up), got {width}")
    inter = width // 2
    _check_out(op, "out", out, (*x.shape[:-1], inter), x)
    if resolve_backend(x.device, backend) == "torch":
        y = F.silu(x[..., :inter]) * x[..., inter:]
        if out is None:
            return y
        out.copy_(y)
        return out
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    _launch_silu_and_mul(out, _read_rows(x, width), inter)
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    inv_freq: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Rotary position embedding, NeoX / Hugging Face "rotate half" layout, in place.

    ``query [T, num_heads, head_dim]`` and ``key [T, num_kv_heads, head_dim]`` (or None) are
    rotated by the angles ``positions[t] * inv_freq`` (``positions [T]`` int32/int64,
    ``inv_freq [head_dim / 2]`` float32): ``x <- x * cos + rotate_half(x) * sin``. They may be
    strided views (e.g. slices of a fused QKV projection's output) with stride 1 in the head
    dim. The angles are computed from the positions in the kernel, so there is no table and
    any position works.

    Exactness: ``RotaryEmbedding.cos_sin`` + ``apply_rotary`` (``models/layers.py``) compute
    the angle as ``fl32(float(p) * inv_freq)``, round its cos/sin to the dtype, then round
    ``x * cos``, ``rotate_half(x) * sin`` and their sum to the dtype. The Triton kernel does
    the same operations in the same order, with libdevice's ``cosf``/``sinf`` (the CUDA math
    library's, which torch's CUDA ``cos``/``sin`` also call) and no FMA contraction, so on a
    GPU it is bit-identical as far as those libraries agree. Under Triton's interpreter numpy's
    ``cos``/``sin`` replace them: a cos/sin that differs in its last fp32 bit may round to a
    neighbouring value of the dtype, which moves the result by at most one dtype ulp of
    ``|x1 * cos| + |x2 * sin|``.
    """
    op = "rotary_embedding"
    head_dim = _check_rotary(op, positions, query, key, inv_freq)
    if resolve_backend(query.device, backend) == "torch":
        _torch_rotary(positions, query, key, inv_freq)
        return
    heads = max(query.shape[1], key.shape[1] if key is not None else 0)
    if _next_power_of_2(heads) * _next_power_of_2(head_dim // 2) > MAX_ROTARY_TILE:
        raise fail(op, f"{heads} heads x head dim {head_dim} is too large for the Triton "
                       "kernel; use backend='torch'")  # fmt: skip
    _launch_rotary(positions.contiguous(), query, key, inv_freq.contiguous())


# --------------------------------------------------------------------------- torch path


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face's LlamaRMSNorm, operation for operation (models/layers.py RMSNorm).
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _torch_rotary(
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


# --------------------------------------------------------------------------- input checks


def _check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise fail(op, f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_norm(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] == 0:
        raise fail(op, "x must be a tensor [..., hidden] with hidden > 0")
    _check_dtype(op, "x", x)
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


def _check_out(
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
    if _rows(out, shape[-1]) is None:
        raise fail(
            op,
            f"{name} needs stride 1 in its last dim and rows one stride apart "
            f"(got strides {out.stride()}); pass a contiguous tensor",
        )


def _check_triton_norm(op: str, hidden: int) -> None:
    if hidden > MAX_HIDDEN:
        raise fail(op, f"the Triton kernel takes hidden sizes up to {MAX_HIDDEN}, got {hidden}; "
                       "use backend='torch'")  # fmt: skip


def _check_rotary(
    op: str,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    inv_freq: torch.Tensor,
) -> int:
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise fail(op, f"query must be [num_tokens, num_heads, head_dim], got {got}")
    _check_dtype(op, "query", query)
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


# --------------------------------------------------------------------------- Triton launchers


def _kernels(device: torch.device):
    return kernels_for(device, "fused_kernels")


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _interpreted(kernel: object) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def _round_mode(dtype: torch.dtype, interpreted: bool) -> int:
    if dtype == torch.float32:
        return _ROUND_NONE
    if dtype == torch.bfloat16 and interpreted:
        return _ROUND_BF16_BITS
    return _ROUND_CAST


def _rows(t: torch.Tensor, width: int) -> torch.Tensor | None:
    """``t [..., width]`` as a 2-D ``[rows, width]`` view with unit last stride, or None."""
    if width > 1 and t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, width)
    except RuntimeError:  # leading dims that no single stride spans
        return None


def _read_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """A read-only input as rows; a copy when its strides do not allow a view."""
    rows = _rows(t, width)
    return rows if rows is not None else t.reshape(-1, width).contiguous()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.data_ptr() == b.data_ptr()


@functools.cache
def _fp32_reciprocal(n: int) -> float:
    """fl32(1 / n): the factor torch's CUDA ``mean`` multiplies the sum by."""
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(float(n), dtype=torch.float32))


def _launch_rms_norm(
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    hidden: int,
) -> None:
    num_rows = x.shape[0]
    if num_rows == 0:
        return
    out2 = _rows(out, hidden)
    res_out2 = _rows(residual_out, hidden) if residual_out is not None else out2
    add = residual is not None
    kernel = _kernels(x.device).rms_norm_kernel
    interpreted = _interpreted(kernel)
    block_h = _next_power_of_2(hidden)
    if interpreted:
        rows = min(_next_power_of_2(num_rows), max(1, _INTERPRETER_TILE // block_h))
        num_warps = 4
    else:  # small rows: several per program; wide rows: more warps (H200, hidden 4096: 8)
        rows = max(1, 1024 // block_h)
        tile = rows * block_h
        num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    residual = residual if add else x
    kernel[(-(-num_rows // rows),)](
        out2, res_out2, x, residual, weight, num_rows,
        x.stride(0), residual.stride(0), out2.stride(0), res_out2.stride(0),
        _fp32_reciprocal(hidden), eps,
        HIDDEN=hidden, BLOCK_H=block_h, ROWS=rows, ADD=add,
        ROUND=_round_mode(x.dtype, interpreted),
        num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip


def _launch_silu_and_mul(out: torch.Tensor, x: torch.Tensor, inter: int) -> None:
    num_rows = x.shape[0]
    if num_rows == 0:
        return
    out2 = _rows(out, inter)
    kernel = _kernels(x.device).silu_and_mul_kernel
    interpreted = _interpreted(kernel)
    if interpreted:
        block = min(_next_power_of_2(inter), _INTERPRETER_TILE)
        rows = min(_next_power_of_2(num_rows), max(1, _INTERPRETER_TILE // block))
    else:  # 1024 elements per program: 16-byte accesses for 16-bit types with 4 warps
        block = min(1024, _next_power_of_2(inter))
        rows = max(1, 1024 // block)
    grid = (-(-num_rows // rows), -(-inter // block))
    kernel[grid](
        out2, x, num_rows, x.stride(0), out2.stride(0),
        INTER=inter, BLOCK=block, ROWS=rows, ROUND=_round_mode(x.dtype, interpreted),
        LIBDEVICE=not interpreted, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip


def _launch_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, inv_freq: torch.Tensor
) -> None:
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    half_pad = _next_power_of_2(half)
    has_key = key is not None and key.shape[1] > 0
    k = key if has_key else query
    block_qh = _next_power_of_2(num_heads)
    block_kh = _next_power_of_2(k.shape[1]) if has_key else 1
    kernel = _kernels(query.device).rotary_kernel
    interpreted = _interpreted(kernel)
    if interpreted:
        rows = min(_next_power_of_2(num_tokens), max(1, _INTERPRETER_TILE // (block_qh * half_pad)))
        num_warps = 4
    else:
        rows = 1
        num_warps = 4 if (block_qh + block_kh) * half_pad <= 4096 else 8
    kernel[(-(-num_tokens // rows),)](
        query, k, positions, inv_freq, num_tokens,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1),
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=k.shape[1], BLOCK_QH=block_qh, BLOCK_KH=block_kh,
        HALF=half, HALF_PAD=half_pad, ROWS=rows, HAS_KEY=has_key,
        ROUND=_round_mode(query.dtype, interpreted), LIBDEVICE=not interpreted,
        num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
