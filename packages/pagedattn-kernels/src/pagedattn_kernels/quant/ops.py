"""The quantization ops: per-token (per-row) dynamic fp8 quantization of activations, the fp8
matmul that takes them with per-channel fp8 weights, and that matmul's kernel on 16-bit
operands (``matmul_16bit``: the engine's bf16 decode batches); each matmul also with SwiGLU's
activation in its epilogue (``*_silu_and_mul``: a fused gate/up projection and
``silu_and_mul`` in one kernel).

It checks its inputs (``checks``), then runs the implementation that fits the tensors' device
(``pagedattn_kernels.common.resolve_backend``): the Triton kernel (``triton_launch``,
``triton_kernels``) or the torch path (``torch_impl``). ``reference`` holds the exact
definition it is tested against. Public through ``pagedattn_kernels.ops``.
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import FP8_DTYPE, capability, check_fp8_triton, fail, resolve_backend
from pagedattn_kernels.quant import torch_impl, triton_launch
from pagedattn_kernels.quant.checks import (
    check_fp8_matmul,
    check_gate_up,
    check_matmul_16bit,
    check_quantize_fp8_per_token,
)

__all__ = [
    "fp8_matmul",
    "fp8_matmul_silu_and_mul",
    "matmul_16bit",
    "matmul_16bit_silu_and_mul",
    "quantize_fp8_per_token",
]


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


def fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    config: object | None = None,
    fast_accum: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """``y [M, N] = (xq @ wq.T) * x_scale * w_scale.T`` in ``out_dtype``: ``xq [M, K]`` e4m3
    rows with one float32 scale each (``quantize_fp8_per_token``'s output), ``wq [N, K]`` an
    e4m3 weight with one float32 scale per output channel (``[N]``, ``[N, 1]`` or ``[1, N]``).
    The products are exact and summed in float32, as ``torch._scaled_mm`` with row-wise
    scales does. The Triton kernel swaps the operands so that a few rows (decode batches)
    waste no tensor-core tile (``triton_kernels.fp8_matmul_kernel``); ``config``: its tiles
    (``triton_launch.Fp8MatmulConfig``; default ``triton_launch.pick_config`` per shape).
    ``fast_accum``: on the GPU, Hopper's fp8 tensor cores sum each K block in their own
    narrower format instead of promoting it to float32, as ``torch._scaled_mm(...,
    use_fast_accum=True)`` (relative error about 2e-3 at K = 4,096 instead of 7e-4, and
    faster); the torch path and the interpreter always sum exactly."""
    check_fp8_matmul(xq, x_scale, wq, w_scale, out, out_dtype)
    m, n = xq.shape[0], wq.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if resolve_backend(xq.device, backend) == "torch":
        return torch_impl.fp8_matmul(xq, x_scale, wq, w_scale, out)
    check_fp8_triton("fp8_matmul", xq.device)
    xq = xq if xq.shape[1] <= 1 or xq.stride(1) == 1 else xq.contiguous()
    wq = wq if wq.shape[1] <= 1 or wq.stride(1) == 1 else wq.contiguous()
    return triton_launch.fp8_matmul(xq, x_scale.contiguous(), wq, w_scale.contiguous(), out,
                                    config, fast_accum)  # fmt: skip


def matmul_16bit(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: object | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``y [M, N] = x @ w.T`` for bfloat16 or float16 ``x [M, K]`` and ``w [N, K]`` (one
    dtype), in that dtype, with float32 sums: what ``F.linear`` computes without a bias. The
    Triton kernel is ``fp8_matmul``'s without scales: the weight rows on the tensor-core
    tile's long side and the few rows of ``x`` on its short side, so that a decode batch
    streams the weights without wasting a tile, and split K is merged by the last split
    instead of a second kernel. On an H200, Llama-3-8B's four linear layers at 1-32 rows took
    113-117 us against cuBLAS's 118-124 (``scripts/bf16_stream_gemm.py``, 9b846dc); from 48
    rows cuBLAS was faster. ``config``: its tiles (``triton_launch.Fp8MatmulConfig``; default
    ``triton_launch.pick_config_16bit`` per shape). The torch path is ``torch.mm``."""
    check_matmul_16bit(x, w, out)
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    if resolve_backend(x.device, backend) == "torch":
        return torch_impl.matmul_16bit(x, w, out)
    if x.device.type == "cuda" and capability(x.device) < (8, 0):
        raise fail("matmul_16bit", f"the Triton kernel needs a GPU of compute capability 8.0 "
                                   f"or newer (this one is {capability(x.device)}); use "
                                   f"backend='torch'")  # fmt: skip
    x = x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()
    w = w if w.shape[1] <= 1 or w.stride(1) == 1 else w.contiguous()
    return triton_launch.matmul_16bit(x, w, out, config)


def fp8_matmul_silu_and_mul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    fp8_out: bool = False,
    config: object | None = None,
    fast_accum: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU's gate/up projection and activation in one kernel: ``silu(y[:, :I]) * y[:, I:]``
    for ``y = fp8_matmul(xq, x_scale, wq, w_scale)`` (``wq [2 I, K]``: the gate's rows, then
    the up projection's), in ``out_dtype``: ``[M, I]``; with ``fp8_out``, those rows quantized
    per token, ``(q [M, I] float8_e4m3fn, scale [M, 1] float32)``, the input of an fp8 down
    projection.

    The same values as the two ops (and ``quantize_fp8_per_token``) one after the other on the
    same backend: ``y`` is rounded to ``out_dtype`` and the activation computed from it as
    ``silu_and_mul`` does. The Triton kernel (``fp8_matmul``'s, GATED) gives each program the
    gate and up rows of the same products, so the projection, twice the activation's size,
    is never stored and the activation needs no kernel of its own; with ``fp8_out`` it also
    keeps each tile's largest magnitude per token, and ``quantize_fp8_tiles_kernel`` then
    quantizes (a token's scale needs the whole row). Its tiles are ``fp8_matmul``'s for the
    shape, unsplit."""
    op = "fp8_matmul_silu_and_mul"
    check_fp8_matmul(xq, x_scale, wq, w_scale, None, out_dtype, op)
    check_gate_up(op, wq)
    if resolve_backend(xq.device, backend) == "torch":
        return torch_impl.fp8_matmul_silu_and_mul(xq, x_scale, wq, w_scale, out_dtype, fp8_out)
    check_fp8_triton(op, xq.device)
    xq = xq if xq.shape[1] <= 1 or xq.stride(1) == 1 else xq.contiguous()
    wq = wq if wq.shape[1] <= 1 or wq.stride(1) == 1 else wq.contiguous()
    return _matmul_silu_and_mul(xq, (x_scale.contiguous(), w_scale.contiguous()), wq, out_dtype,
                                fp8_out, config, fast_accum)  # fmt: skip


def matmul_16bit_silu_and_mul(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    config: object | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """:func:`fp8_matmul_silu_and_mul` on 16-bit operands: ``silu(y[:, :I]) * y[:, I:]`` for
    ``y = matmul_16bit(x, w)`` (``w [2 I, K]``), ``[M, I]`` in x's dtype, by
    ``matmul_16bit``'s kernel with the activation in its epilogue (the engine's bf16 decode
    batches: one kernel fewer a layer). The torch path is ``torch.mm`` then the activation."""
    op = "matmul_16bit_silu_and_mul"
    check_matmul_16bit(x, w, None, op)
    check_gate_up(op, w)
    if resolve_backend(x.device, backend) == "torch":
        return torch_impl.matmul_16bit_silu_and_mul(x, w)
    if x.device.type == "cuda" and capability(x.device) < (8, 0):
        raise fail(op, f"the Triton kernel needs a GPU of compute capability 8.0 or newer "
                       f"(this one is {capability(x.device)}); use backend='torch'")  # fmt: skip
    x = x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()
    w = w if w.shape[1] <= 1 or w.stride(1) == 1 else w.contiguous()
    return _matmul_silu_and_mul(x, None, w, x.dtype, False, config, False)


def _matmul_silu_and_mul(x: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
                         w: torch.Tensor, out_dtype: torch.dtype, fp8_out: bool,
                         config: object | None,
                         fast_accum: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The Triton path of both ops: the GATED kernel, then with ``fp8_out`` the quantization
    from its tile maxima."""
    m, n = x.shape[0], w.shape[0]
    out = torch.empty((m, n // 2), dtype=out_dtype, device=x.device)
    amax = triton_launch.matmul_silu_and_mul(x, scales, w, out, fp8_out, config, fast_accum)
    if not fp8_out:
        return out
    q = torch.empty(out.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    return triton_launch.quantize_fp8_from_maxima(out, amax, q, scale)
