"""Launchers of the fused elementwise kernels (``triton_kernels.py``): tile shapes, grids, and
the constexpr flags that select the rounding of each dtype.

Inputs arrive checked (``ops`` checks them); outputs are allocated by ``ops``. CUDA tensors get
the compiled kernels, CPU tensors the same kernels in Triton's interpreter
(``pagedattn_kernels.common.kernels_for``). Every launch passes ``enable_fp_fusion=False``: no
multiply and add get contracted into one FMA where torch, running them as separate kernels,
rounds twice.
"""

from __future__ import annotations

import functools
import os

import torch

from pagedattn_kernels.common import (
    FP8_DTYPE,
    e4m3_encoder,
    is_interpreted,
    kernels_for,
    next_power_of_2,
    round_mode,
    scale_or_unit,
    sm_count,
    use_pdl,
)
from pagedattn_kernels.quant import triton_launch as quant_launch
from pagedattn_kernels.quant.torch_impl import MIN_SCALE

KERNELS = "pagedattn_kernels.fused.triton_kernels"

#: Widest row the Triton RMSNorm takes (one program holds a whole row in registers).
MAX_HIDDEN = 32768
#: Largest ``heads x head_dim / 2`` tile the Triton rotary kernel takes per token.
MAX_ROTARY_TILE = 32768

# Interpreted launches pay per operation, not per element: few programs with big tiles.
_INTERPRETER_TILE = 1 << 16
#: Rotary grids split over heads (``_rotary_grid``): query heads per program such that a
#: program holds at most this many (head, dim) pairs (Llama-3-8B's head_dim 128: 8 heads) ...
ROTARY_SPLIT_PAIRS = 512
#: ... and the split is taken while the split grid has at most this many programs per SM.
ROTARY_SPLIT_PER_SM = 4


def row_view(t: torch.Tensor, width: int) -> torch.Tensor | None:
    """``t [..., width]`` as a 2-D ``[rows, width]`` view with unit last stride, or None."""
    if width > 1 and t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, width)
    except RuntimeError:  # leading dims that no single stride spans
        return None


def read_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """A read-only input as rows; a copy when its strides do not allow a view."""
    rows = row_view(t, width)
    return rows if rows is not None else t.reshape(-1, width).contiguous()


@functools.cache
def _fp32_reciprocal(n: int) -> float:
    """fl32(1 / n): the factor torch's CUDA ``mean`` multiplies the sum by."""
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(float(n), dtype=torch.float32))


def rms_norm(
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    hidden: int,
    fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``rms_norm_kernel`` over the rows of ``x [rows, hidden]``: the plain norm into ``out``
    (``residual`` None), or, with ``residual``, the sum into ``residual_out`` and its norm into
    ``out`` (both ops' Triton path). With ``fp8_out = (q [rows, hidden] e4m3, scale [rows, 1]
    float32)`` the norm goes there, quantized per token, and ``out`` (any tensor of x's dtype
    and shape, e.g. ``x``) is not written."""
    num_rows = x.shape[0]
    if num_rows == 0:
        return
    out2 = row_view(out, hidden)
    res_out2 = row_view(residual_out, hidden) if residual_out is not None else out2
    add = residual is not None
    kernel = kernels_for(x.device, KERNELS).rms_norm_kernel
    interpreted = is_interpreted(kernel)
    block_h = next_power_of_2(hidden)
    if interpreted:
        rows = min(next_power_of_2(num_rows), max(1, _INTERPRETER_TILE // block_h))
        num_warps = 4
    else:  # small rows: several per program; wide rows: more warps (H200, hidden 4096: 8)
        rows = max(1, 1024 // block_h)
        tile = rows * block_h
        num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    residual = residual if add else x
    q, scale = fp8_out if fp8_out is not None else (out2, out2)
    pdl = use_pdl(x.device)
    kernel[(-(-num_rows // rows),)](
        out2, res_out2, x, residual, weight, num_rows,
        x.stride(0), residual.stride(0), out2.stride(0), res_out2.stride(0),
        _fp32_reciprocal(hidden), eps, q, scale, q.stride(0), MIN_SCALE,
        HIDDEN=hidden, BLOCK_H=block_h, ROWS=rows, ADD=add,
        ROUND=round_mode(x.dtype, interpreted), QUANT=_quant_mode(kernel, x, fp8_out),
        PDL=pdl, launch_pdl=pdl, num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip


def _quant_mode(kernel: object, x: torch.Tensor, fp8_out: object) -> int:
    """The kernels' QUANT: 0 stores the model dtype, else the e4m3 encoder to quantize with."""
    return e4m3_encoder(kernel, x.device) if fp8_out is not None else 0


def silu_and_mul(out: torch.Tensor, x: torch.Tensor, inter: int,
                 fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 method: str | None = None) -> None:  # fmt: skip
    """``silu_and_mul_kernel``: ``x [rows, 2 * inter]`` (gate, up) -> ``out [..., inter]``, or
    with ``fp8_out = (q [rows, inter] e4m3, scale [rows, 1] float32)`` quantized per token
    there (``out`` then only gives the dtype and is not written) by ``method``
    (``SILU_FP8_METHODS``): a program per row (``"row"``), two tiled kernels (``"tiled"``) or
    whole rows in two passes through a scratch row (``"two_pass"``,
    ``silu_and_mul_fp8_rows_kernel``).

    ``method`` None: a program per row in the interpreter, where programs cost most; compiled,
    tiled below ``SILU_FP8_TWO_PASS_MIN_ROWS`` rows and two passes from there. On an H200
    (Llama-3-8B's 14,336, CUDA graphs, dda1cca) tiled took 3.7 / 10.1 / 19.7 / 37.4 us at 16 /
    256 / 512 / 1,024 rows against 6.5 / 12.6 / 24.5 / 50.9 for a program per row (98
    registers x 512 threads: one program per SM, whose load, reduction and store phases do
    not overlap) and 4.3 / 10.2 / 21.3 / 44.2 for the plain kernel then the quantization
    (``python -m pagedkv.bench.kernels --gemm-only``, ``quant[]``); at 16,384 rows, a prefill
    pass's, tiled took 652 us, 30% of the copy bandwidth in the bytes it must move, and two
    passes 473 us (``SILU_FP8_TWO_PASS_MIN_ROWS`` has the figures)."""
    num_rows = x.shape[0]
    if num_rows == 0:
        return
    kernel = kernels_for(x.device, KERNELS).silu_and_mul_kernel
    interpreted = is_interpreted(kernel)
    if fp8_out is not None:
        if method is None:
            method = ("row" if interpreted else
                      "two_pass" if num_rows >= SILU_FP8_TWO_PASS_MIN_ROWS else "tiled")  # fmt: skip
        if method not in SILU_FP8_METHODS:
            raise ValueError(f"silu_and_mul: method must be one of {SILU_FP8_METHODS}, "
                             f"got {method!r}")  # fmt: skip
        if method == "tiled":
            _silu_and_mul_fp8_tiled(kernel, x, inter, *fp8_out)
            return
        if method == "two_pass":
            _silu_and_mul_fp8_two_pass(x, inter, *fp8_out)
            return
    out2 = row_view(out, inter) if fp8_out is None else x
    num_warps = 4
    if fp8_out is not None:  # whole rows: the scale needs the row's largest magnitude
        block = next_power_of_2(inter)
        rows = (
            min(next_power_of_2(num_rows), max(1, _INTERPRETER_TILE // block)) if interpreted else 1
        )
        num_warps = 4 if interpreted or block <= 1024 else 8 if block <= 4096 else 16
    elif interpreted:
        block = min(next_power_of_2(inter), _INTERPRETER_TILE)
        rows = min(next_power_of_2(num_rows), max(1, _INTERPRETER_TILE // block))
    else:  # 1024 elements per program: 16-byte accesses for 16-bit types with 4 warps
        block = min(1024, next_power_of_2(inter))
        rows = max(1, 1024 // block)
    q, scale = fp8_out if fp8_out is not None else (out2, out2)
    grid = (-(-num_rows // rows), -(-inter // block))
    pdl = use_pdl(x.device)
    kernel[grid](
        out2, x, num_rows, x.stride(0), out2.stride(0), q, scale, q.stride(0), MIN_SCALE, out2, 1,
        INTER=inter, BLOCK=block, ROWS=rows, ROUND=round_mode(x.dtype, interpreted),
        LIBDEVICE=not interpreted, QUANT=_quant_mode(kernel, x, fp8_out), AMAX=False,
        PDL=pdl, launch_pdl=pdl, num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip


#: The ways ``silu_and_mul`` makes fp8 rows.
SILU_FP8_METHODS = ("row", "tiled", "two_pass")
#: Rows from which compiled SiLU-and-multiply to fp8 takes two passes over whole rows
#: (``silu_and_mul``); ``PAGEDATTN_SILU_FP8_TWO_PASS_MIN_ROWS`` (read at import) moves it,
#: for A/B runs. On an H200 (Llama-3-8B's 14,336, CUDA graphs, ``scripts/silu_fp8_rows.py
#: --two-pass``, 4453a04) two passes took 8.4 / 16.6 / 31.9 / 120.4 / 473.5 us at 256 / 512 /
#: 1,024 / 4,096 / 16,384 rows against 10.1 / 21.8 / 42.8 / 163.8 / 654.6 for the tiled pair;
#: at 128 rows and fewer the tiled pair's many short programs win (5.9 against 8.9 us at 128
#: with four-warp programs, 90d0ab0).
SILU_FP8_TWO_PASS_MIN_ROWS = int(os.environ.get("PAGEDATTN_SILU_FP8_TWO_PASS_MIN_ROWS", "256"))
#: ``silu_and_mul_fp8_rows_kernel``'s tiles: columns a step, warps and programs per SM (the
#: persistent grid, each program with its scratch row). The H200 sweeps of 90d0ab0 and 4453a04
#: (``gpu_runs/2026-12-04d/``): 2,048 columns and eight warps (54 registers a thread on sm_90,
#: so four programs an SM) were the fastest or within 3% of it at every row count; four warps
#: took 633 us at 16,384 rows. Two software-pipeline stages in the first pass were slower
#: (the kernel runs one), and L2 eviction hints (the scratch rows kept, the rest let go first)
#: made no steady difference: both options were measured there and removed.
TWO_PASS_BLOCK, TWO_PASS_WARPS, TWO_PASS_PER_SM = 2048, 8, 4


def _silu_and_mul_fp8_two_pass(x: torch.Tensor, inter: int, q: torch.Tensor, scale: torch.Tensor,
                               block: int | None = None, num_warps: int | None = None,
                               per_sm: int | None = None) -> None:  # fmt: skip
    """``silu_and_mul_fp8_rows_kernel`` over ``x [rows, 2 * inter]`` into ``q`` and ``scale``:
    a persistent grid of ``per_sm`` programs an SM (at most one per row), ``block`` columns a
    step. In the interpreter, which has no SMs: ``per_sm`` programs in all (default: one per
    row), and the whole row a step unless ``block`` says otherwise (tests use both to make
    programs take several rows and rows take several steps)."""
    kernel = kernels_for(x.device, KERNELS).silu_and_mul_fp8_rows_kernel
    num_rows = x.shape[0]
    interpreted = is_interpreted(kernel)
    if interpreted:
        block = block or min(next_power_of_2(inter), _INTERPRETER_TILE)
        programs = min(num_rows, per_sm or num_rows)
    else:
        block = block or min(TWO_PASS_BLOCK, next_power_of_2(inter))
        programs = min(num_rows, sm_count(x.device) * (per_sm or TWO_PASS_PER_SM))
    scratch = torch.empty(programs, inter, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x.device)
    kernel[(programs,)](
        x, scratch, q, scale, num_rows, x.stride(0), q.stride(0), MIN_SCALE, INTER=inter,
        BLOCK=block, ROUND=round_mode(x.dtype, interpreted), LIBDEVICE=not interpreted,
        E4M3=e4m3_encoder(kernel, x.device), PDL=pdl, launch_pdl=pdl,
        num_warps=num_warps or TWO_PASS_WARPS, num_stages=1, enable_fp_fusion=False,
    )  # fmt: skip


def _silu_and_mul_fp8_tiled(kernel: object, x: torch.Tensor, inter: int, q: torch.Tensor,
                            scale: torch.Tensor) -> None:  # fmt: skip
    """SiLU-and-multiply to fp8 rows in two tiled kernels: the products in the model dtype with
    each tile's largest magnitude per row (AMAX), then ``quantize_fp8_from_maxima``. The
    products make one extra round trip (mostly through L2) against a program per row, which
    keeps a whole row in registers but runs few, long programs."""
    num_rows = x.shape[0]
    interpreted = is_interpreted(kernel)
    rows, block = quant_launch.tile_shape(num_rows, inter, interpreted)
    chunks = -(-inter // block)
    y = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    partial = torch.empty(num_rows, chunks, dtype=torch.float32, device=x.device)
    pdl = use_pdl(x.device)
    kernel[(-(-num_rows // rows), chunks)](
        y, x, num_rows, x.stride(0), y.stride(0), y, y, y.stride(0), MIN_SCALE, partial, chunks,
        INTER=inter, BLOCK=block, ROWS=rows, ROUND=round_mode(x.dtype, interpreted),
        LIBDEVICE=not interpreted, QUANT=0, AMAX=True, PDL=pdl, launch_pdl=pdl, num_warps=4,
        enable_fp_fusion=False,
    )  # fmt: skip
    quant_launch.quantize_fp8_from_maxima(y, partial, q, scale, block)


def _rotary_tiles(kernel: object, num_tokens: int, block_qh: int, block_kh: int,
                  half_pad: int) -> tuple[int, int]:  # fmt: skip
    """(tokens per program, warps) of the rotary kernels: one token per program when compiled,
    as many as fill the interpreter's tile when interpreted."""
    if is_interpreted(kernel):
        fill = max(1, _INTERPRETER_TILE // (block_qh * half_pad))
        return min(next_power_of_2(num_tokens), fill), 4
    return 1, 4 if (block_qh + block_kh) * half_pad <= 4096 else 8


def rotary_head_groups(num_heads: int, num_kv_heads: int, half_pad: int,
                       cache: bool) -> tuple[int, int]:  # fmt: skip
    """(query heads, key heads) per program of a rotary grid split over heads: query heads up
    to ``ROTARY_SPLIT_PAIRS`` pairs a program (a power of two), key heads half as many when
    the program also writes them and their values into the cache (``cache``: about 2.5 times
    a query head's loads and stores)."""
    q = min(next_power_of_2(num_heads), max(1, ROTARY_SPLIT_PAIRS // half_pad))
    k = max(1, q // 2) if cache else q
    return q, min(k, next_power_of_2(num_kv_heads))


def _rotary_grid(kernel: object, device: torch.device, num_tokens: int, num_heads: int,
                 num_kv_heads: int, half_pad: int, cache: bool, split: bool | None,
                 groups: tuple[int, int] | None) -> tuple[int, int, int, int, int]:  # fmt: skip
    """(tokens per program, head splits, query heads per program, key heads per program,
    warps) of a rotary launch; ``num_kv_heads`` 0: no key.

    One program per token rotates all of its heads (HEAD_SPLITS 1). Compiled, a decode batch
    then makes a small, latency-bound grid: on an H200, Llama-3-8B's ``rotary_and_cache_kernel``
    took ~4.6 us at 16 tokens, 16 programs of 48 heads each with most SMs idle. So with
    ``split`` None each token's heads are split over programs (``groups``, default
    ``rotary_head_groups``) when compiled and the split grid has at most
    ``ROTARY_SPLIT_PER_SM`` programs per SM: Llama-3-8B with the cache write, 4 programs of 8
    query heads and 2 of 4 key heads a token, split up to 88 tokens on 132 SMs (offline sm_90
    compile: 51 registers a thread, 53 for an fp8 cache, against 89 unsplit). Larger batches
    fill the GPU a program per token. On an H200 (fp8 cache, PDL off, a3968e0's profile) the
    kernel took 103.9 / 109.2 us of a decode step at 16 / 64 sequences against 148.3 / 154.3
    a program per token (2d09a7d). ``split`` True / False
    forces either (tests: the interpreter never splits by itself); a split that leaves one
    program per token is none."""
    q_group, k_group = groups or rotary_head_groups(num_heads, num_kv_heads, half_pad, cache)
    if q_group < 1 or k_group < 1 or q_group & (q_group - 1) or k_group & (k_group - 1):
        raise ValueError(f"rotary head groups must be powers of two, got {groups}")
    splits = -(-num_heads // q_group) + (-(-num_kv_heads // k_group) if num_kv_heads else 0)
    if split is None:
        sms = sm_count(device)
        split = not is_interpreted(kernel) and num_tokens * splits <= ROTARY_SPLIT_PER_SM * sms
    if split and splits > 1:
        rows, num_warps = _rotary_tiles(kernel, num_tokens, max(q_group, k_group), 0, half_pad)
        return rows, splits, q_group, k_group, num_warps
    block_qh, block_kh = next_power_of_2(num_heads), next_power_of_2(num_kv_heads)
    rows, num_warps = _rotary_tiles(kernel, num_tokens, block_qh, block_kh, half_pad)
    return rows, 1, block_qh, block_kh, num_warps


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    inv_freq: torch.Tensor,
    *,
    split: bool | None = None,
    groups: tuple[int, int] | None = None,
) -> None:
    """``rotary_kernel``: rotates ``query`` and ``key`` (or only ``query``) in place; ``split``
    and ``groups``: the grid over heads (``_rotary_grid``)."""
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    half_pad = next_power_of_2(half)
    has_key = key is not None and key.shape[1] > 0
    k = key if has_key else query
    kernel = kernels_for(query.device, KERNELS).rotary_kernel
    interpreted = is_interpreted(kernel)
    rows, head_splits, block_qh, block_kh, num_warps = _rotary_grid(
        kernel, query.device, num_tokens, num_heads, k.shape[1] if has_key else 0, half_pad,
        False, split, groups,
    )  # fmt: skip
    pdl = use_pdl(query.device)
    kernel[(-(-num_tokens // rows), head_splits)](
        query, k, positions, inv_freq, num_tokens,
        query.stride(0), query.stride(1), k.stride(0), k.stride(1),
        NUM_Q_HEADS=num_heads, NUM_K_HEADS=k.shape[1], BLOCK_QH=block_qh, BLOCK_KH=block_kh,
        HALF=half, HALF_PAD=half_pad, ROWS=rows, HAS_KEY=has_key,
        ROUND=round_mode(query.dtype, interpreted), LIBDEVICE=not interpreted,
        HEAD_SPLITS=head_splits, PDL=pdl, launch_pdl=pdl, num_warps=num_warps,
        enable_fp_fusion=False,
    )  # fmt: skip


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    inv_freq: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    split: bool | None = None,
    groups: tuple[int, int] | None = None,
) -> None:
    """``rotary_and_cache_kernel``: rotates ``query`` and ``key`` in place and writes the
    rotated keys and the values into their cache slots; ``split`` and ``groups``: the grid
    over heads (``_rotary_grid``)."""
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    num_kv_heads = key.shape[1]
    half = head_dim // 2
    half_pad = next_power_of_2(half)
    kernel = kernels_for(query.device, KERNELS).rotary_and_cache_kernel
    interpreted = is_interpreted(kernel)
    rows, head_splits, block_qh, block_kh, num_warps = _rotary_grid(
        kernel, query.device, num_tokens, num_heads, num_kv_heads, half_pad, True, split, groups
    )
    pdl = use_pdl(query.device)
    kernel[(-(-num_tokens // rows), head_splits)](
        query, key, value, positions, inv_freq, key_cache, value_cache, slot_mapping,
        scale_or_unit(k_scale, key_cache), scale_or_unit(v_scale, value_cache), num_tokens,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_QH=block_qh, BLOCK_KH=block_kh,
        HALF=half, HALF_PAD=half_pad, ROWS=rows, BLOCK_SIZE=key_cache.shape[1],
        KV_FP8=key_cache.dtype == FP8_DTYPE, E4M3=e4m3_encoder(kernel, query.device),
        ROUND=round_mode(query.dtype, interpreted), LIBDEVICE=not interpreted,
        HEAD_SPLITS=head_splits, PDL=pdl, launch_pdl=pdl, num_warps=num_warps,
        enable_fp_fusion=False,
    )  # fmt: skip
