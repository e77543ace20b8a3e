"""Fused elementwise ops of a decoder layer: RMSNorm (alone, or with the residual add fused in),
SiLU-and-multiply, rotary embedding (alone, or with the cache write that follows it in an
attention layer: ``rotary_embedding_and_cache``); and the norms and SiLU-and-multiply with
their output quantized per token to fp8 in the same kernel (``*_fp8``: the inputs of fp8
linear layers).

Unfused, each is a chain of small torch kernels that every one reads and writes the whole
activation (RMSNorm alone is eight: add, cast, square, mean, add, rsqrt, multiply, cast,
multiply), which at decode batch sizes costs more in launches and memory traffic than the
arithmetic. Fused, each is one kernel that reads its inputs once and writes its outputs once.

Numerics: each op reproduces the rounding sequence of the torch composition the Llama model
runs unfused (``pagedkv.engine.models.layers``: Hugging Face's), see each op's docstring for
how exactly. The backend follows the tensors' device like every op here (CUDA -> Triton, CPU
-> torch, ``backend=`` or ``PAGEDATTN_BACKEND`` to force one; ``triton`` on CPU tensors runs
the kernels in Triton's interpreter). The torch path (``torch_impl``) *is* the unfused
composition; the Triton path is ``triton_launch`` (launchers) and ``triton_kernels`` (device
code); ``checks`` holds the input checks and ``reference`` the float64 math the tests bound the
ops' error against. Public through ``pagedattn_kernels.ops``.

In place: ``rms_norm`` and ``fused_add_rms_norm`` write where ``out`` / ``residual_out`` say
(new tensors when None); passing ``out=x, residual_out=residual`` updates the caller's
tensors in place (vLLM's convention) without allocating. ``rotary_embedding`` always rotates
``query`` and ``key`` in place. Nothing here reads a value on the host, allocates an amount
that depends on values, or syncs the device, so every op can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from pagedattn_kernels.cache.checks import check_reshape_and_cache
from pagedattn_kernels.common import (
    FP8_DTYPE,
    check_fp8_triton,
    check_kv_scales,
    check_unit_stride,
    fail,
    resolve_backend,
)
from pagedattn_kernels.fused import torch_impl, triton_launch
from pagedattn_kernels.fused.checks import (
    check_norm,
    check_out,
    check_rotary,
    check_silu_and_mul,
    check_triton_norm,
    check_triton_rotary,
    same_memory,
)
from pagedattn_kernels.fused.triton_launch import MAX_HIDDEN, read_rows

__all__ = [
    "MAX_HIDDEN",
    "fused_add_rms_norm",
    "fused_add_rms_norm_fp8",
    "rms_norm",
    "rms_norm_fp8",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
    "silu_and_mul_fp8",
]


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
    hidden = check_norm(op, x, None, weight, eps)
    check_out(op, "out", out, x.shape, x)
    if resolve_backend(x.device, backend) == "torch":
        return torch_impl.rms_norm(x, weight, eps, out)
    check_triton_norm(op, hidden)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    triton_launch.rms_norm(
        out, None, read_rows(x, hidden), None, weight.contiguous(), float(eps), hidden
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
    hidden = check_norm(op, x, residual, weight, eps)
    check_out(op, "out", out, x.shape, x)
    check_out(op, "residual_out", residual_out, x.shape, x)
    if out is not None and residual_out is not None and same_memory(out, residual_out):
        raise fail(op, "out and residual_out must be different tensors")
    if resolve_backend(x.device, backend) == "torch":
        return torch_impl.fused_add_rms_norm(x, residual, weight, eps, out, residual_out)
    check_triton_norm(op, hidden)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    triton_launch.rms_norm(
        out, residual_out, read_rows(x, hidden), read_rows(residual, hidden),
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
    inter = check_silu_and_mul(op, x, out)
    if resolve_backend(x.device, backend) == "torch":
        return torch_impl.silu_and_mul(x, out)
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    triton_launch.silu_and_mul(out, read_rows(x, 2 * inter), inter)
    return out


def _fp8_rows(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh outputs of an ``*_fp8`` op: e4m3 rows ``[..., width]`` and their scales ``[..., 1]``."""
    lead = tuple(x.shape[:-1])
    return (torch.empty((*lead, width), dtype=FP8_DTYPE, device=x.device),
            torch.empty((*lead, 1), dtype=torch.float32, device=x.device))  # fmt: skip


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` with its output quantized per token to fp8, the input of an fp8 linear
    layer (``--quantization fp8``) in one kernel: returns ``(q [..., hidden] float8_e4m3fn,
    scale [..., 1] float32)``: ``quantize_fp8_per_token`` of :func:`rms_norm`'s rows (the
    normed values are rounded to x's dtype first, as unfused), without writing them in x's
    dtype and reading them back. The torch path and the interpreter give exactly the unfused
    composition's bits; the compiled kernel may add the squares in another order than the
    plain norm kernel, so a scale can differ in its last fp32 bit and a rare code by one step
    (on an H200: float32 rows of 4096; bfloat16 and float16 were identical)."""
    op = "rms_norm_fp8"
    hidden = check_norm(op, x, None, weight, eps)
    if resolve_backend(x.device, backend) == "torch":
        return torch_impl.rms_norm_fp8(x, weight, eps)
    check_triton_norm(op, hidden)
    check_fp8_triton(op, x.device)
    q, scale = _fp8_rows(x, hidden)
    rows = read_rows(x, hidden)
    triton_launch.rms_norm(rows, None, rows, None, weight.contiguous(), float(eps), hidden,
                           fp8_out=(q.view(-1, hidden), scale.view(-1, 1)))  # fmt: skip
    return q, scale


def fused_add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_add_rms_norm` with the normed rows quantized per token to fp8: returns
    ``(q, scale, new_residual)``, ``q``/``scale`` as :func:`rms_norm_fp8` gives them for
    ``new_residual = x + residual`` (written to ``residual_out``, a new tensor when None;
    ``residual_out=residual`` updates it in place)."""
    op = "fused_add_rms_norm_fp8"
    hidden = check_norm(op, x, residual, weight, eps)
    check_out(op, "residual_out", residual_out, x.shape, x)
    if resolve_backend(x.device, backend) == "torch":
        return torch_impl.fused_add_rms_norm_fp8(x, residual, weight, eps, residual_out)
    check_triton_norm(op, hidden)
    check_fp8_triton(op, x.device)
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q, scale = _fp8_rows(x, hidden)
    rows = read_rows(x, hidden)
    triton_launch.rms_norm(
        rows, residual_out, rows, read_rows(residual, hidden), weight.contiguous(), float(eps),
        hidden, fp8_out=(q.view(-1, hidden), scale.view(-1, 1)),
    )  # fmt: skip
    return q, scale, residual_out


def silu_and_mul_fp8(
    x: torch.Tensor, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`silu_and_mul` with its output quantized per token to fp8 (the input of an fp8
    down projection) in one kernel: ``(q [..., I] float8_e4m3fn, scale [..., 1] float32)``,
    exactly ``quantize_fp8_per_token`` of :func:`silu_and_mul`'s rows on the same backend
    (elementwise: no sum order to differ).
    A program holds a whole row (the scale needs its largest magnitude): the Triton path takes
    ``I <= MAX_HIDDEN``."""
    op = "silu_and_mul_fp8"
    inter = check_silu_and_mul(op, x, None)
    if resolve_backend(x.device, backend) == "torch":
        return torch_impl.silu_and_mul_fp8(x)
    check_triton_norm(op, inter)
    check_fp8_triton(op, x.device)
    q, scale = _fp8_rows(x, inter)
    triton_launch.silu_and_mul(x, read_rows(x, 2 * inter), inter,
                               fp8_out=(q.view(-1, inter), scale.view(-1, 1)))  # fmt: skip
    return q, scale


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
    check_rotary(op, positions, query, key, inv_freq)
    if resolve_backend(query.device, backend) == "torch":
        torch_impl.rotary_embedding(positions, query, key, inv_freq)
        return
    check_triton_rotary(op, query, key)
    triton_launch.rotary_embedding(positions.contiguous(), query, key, inv_freq.contiguous())


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
    backend: str | None = None,
) -> None:
    """:func:`rotary_embedding` of ``query`` and ``key`` (in place), then
    ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)`` of the rotated keys:
    what an attention layer does to its new tokens before it attends.

    The Triton path is one kernel: the rotated keys go from registers to their cache slots,
    instead of being written back, launched again, read again. At decode batch sizes these are
    tiny, latency-bound kernels, so the launch saved is most of the cost. The results are those
    of the two ops in sequence on the same backend, bit for bit (the same roundings in the
    same order); ``k_scale``/``v_scale`` and slot -1 mean what they mean for
    ``reshape_and_cache``. Everything is checked before anything is written.
    """
    op = "rotary_embedding_and_cache"
    if key is None:
        raise fail(op, "key must be a tensor: its rotated rows are what the cache stores")
    check_rotary(op, positions, query, key, inv_freq)
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, op)
    check_kv_scales(op, key_cache, k_scale, v_scale)
    if same_memory(value, key) or same_memory(value, query):
        raise fail(op, "value must not share memory with query or key (they are rotated in place)")
    if resolve_backend(query.device, backend) == "torch":
        torch_impl.rotary_embedding_and_cache(positions, query, key, value, inv_freq, key_cache,
                                              value_cache, slot_mapping, k_scale, v_scale)  # fmt: skip
        return
    check_triton_rotary(op, query, key)
    check_unit_stride(op, key_cache=key_cache, value_cache=value_cache)
    if key_cache.dtype == FP8_DTYPE:
        check_fp8_triton(op, key_cache.device)
    value = value if value.stride(-1) == 1 else value.contiguous()
    triton_launch.rotary_embedding_and_cache(
        positions.contiguous(), query, key, value, inv_freq.contiguous(), key_cache, value_cache,
        slot_mapping, k_scale, v_scale,
    )  # fmt: skip
