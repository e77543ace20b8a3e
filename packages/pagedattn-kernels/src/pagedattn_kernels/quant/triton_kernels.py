"""The Triton kernels of the quantization ops (device code only; the launchers are in
``triton_launch``): per-token fp8 quantization, one program per row or tiled, and the fp8
matmul that takes its output (``fp8_matmul_kernel``).

Per row (``quantize_fp8_per_token_kernel``): a program holds a row of up to 16,384 values in
registers (a Llama-3-8B row is at most 14,336 wide) and reads it once; a longer row is read
twice, a chunk at a time: once for the largest magnitude, once to divide and store (the second
read mostly from L2).

Tiled (``row_chunk_amax_kernel`` then ``quantize_fp8_tiles_kernel``): small tiles, many
programs; the first kernel writes each tile's largest magnitude per row, the second reads the
row's few maxima and quantizes its tile. For rows already in memory a program per row is
faster (it reads them once; the launcher's docstring has the timings), so the pair serves
SiLU-and-multiply: its tiled kernel makes the products and their tile maxima together
(``fused/triton_kernels.silu_and_mul_kernel``'s AMAX), and the second kernel quantizes them.

Each value is ``e4m3(clamp(x / scale))`` exactly as the torch path computes it, at a few
instructions a value (sm_90 offline compiles, Triton 3.6: 45 instructions a value before, 16
now, for rows of 14,336):
- the quotient is correctly rounded without a division per value (``_quotient``): one
  reciprocal per row, then a product and one FMA correction;
- the e4m3 code (nearest, ties to even) comes from the hardware's conversion, or, where that
  is missing or rounds otherwise (the interpreter, GPUs before sm_89), from integer
  operations (``_e4m3``, ``E4M3``; see ``pagedattn_kernels.common.e4m3_encoder``).
These helpers are repeated in the cache and fused kernel modules because a kernel module holds
its own helpers. Like every kernel module here, this file is loaded twice when both compiled
and interpreted kernels are needed and calls only Triton builtins (see
``attention/triton_kernels.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _quotient(x, scale, recip):
    """fp32 ``x / scale`` correctly rounded, from ``recip = div_rn(1, scale)``: q0 = x * recip
    is within about an ulp, the FMA gives the exact remainder x - q0 * scale, and one more
    FMA rounds q0 + remainder * recip to the nearest (Markstein's theorem; the sequence of
    CUDA's own division after its reciprocal). It holds while nothing overflows or becomes
    subnormal: quotients beyond +-448 (clamped next, so q0 is kept) and below 2^-126 (e4m3
    zero either way) are the only ones outside. Checked against IEEE division on 1.4e8
    bfloat16 and float32 quotients, adversarial divisors included: no difference."""
    q0 = x * recip
    q1 = tl.fma(tl.fma(-q0, scale, x), recip, q0)
    return tl.where(tl.abs(q0) <= 448.0, q1, q0)


@triton.jit
def _e4m3(y, E4M3: tl.constexpr):
    """fp32 ``y`` (already within +-448) to e4m3, nearest value, ties to even. E4M3 2: the
    hardware conversion. E4M3 1: integer operations, no float-to-fp8 conversion at all.
    Normal values (|y| >= 2^-6): keep
    3 of the 23 mantissa bits, adding half an ulp plus the tie bit (a carry moves into the
    exponent as it should), and rebias the exponent from 127 to 7. Below (subnormal e4m3,
    steps of 2^-9): |y| * 512 rounded to an integer in float32's own round-to-even, read back
    from the bits of |y| * 512 + 2^23; the code 8 is 2^-6, the first normal value."""
    if E4M3 == 2:
        return y.to(tl.float8e4nv)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960  # 960 == (127 - 7) << 3
    steps = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    subnormal = steps.to(tl.int32, bitcast=True) - 0x4B000000  # 0x4B000000: the bits of 2^23
    code = tl.where(mag < 0x3C800000, subnormal, normal) | sign  # 0x3C800000: 2^-6
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def quantize_fp8_per_token_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    cols,
    stride_x,
    stride_o,
    min_scale,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    E4M3: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid: (rows,). ``scale = max(amax / 448, min_scale)``; ``out = e4m3(clamp(x / scale))``.

    ONE_PASS (BLOCK >= cols): the row stays in registers between the largest magnitude and
    the division, so it is read once. ``cols`` and the strides are specialized on (a model
    has a few widths): unknown to be multiples of 16, they made every load and store one
    element wide (sm_90 SASS: LDG.E.U16 and STG.E.U8 per value)."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * stride_o
    c = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = c < cols
        x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(x), 0, tl.standard._elementwise_max)
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), min_scale)
        tl.store(scale_ptr + row, scale)
        y = _quotient(x, scale, tl.math.div_rn(1.0, scale))
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(o_row + c, _e4m3(y, E4M3), mask=mask)
        return
    amax = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, cols, BLOCK):
        x = tl.load(x_row + start + c, mask=start + c < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(
        tl.math.div_rn(tl.reduce(amax, 0, tl.standard._elementwise_max), 448.0), min_scale
    )
    tl.store(scale_ptr + row, scale)
    recip = tl.math.div_rn(1.0, scale)
    for start in range(0, cols, BLOCK):
        mask = start + c < cols
        x = tl.load(x_row + start + c, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(_quotient(x, scale, recip), -448.0), 448.0)
        tl.store(o_row + start + c, _e4m3(y, E4M3), mask=mask)


@triton.jit(do_not_specialize=["rows"])
def row_chunk_amax_kernel(
    x_ptr,
    partial_ptr,
    rows,
    cols,
    stride_x,
    chunks,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Tiled per-token quantization, first kernel. Grid: (cdiv(rows, ROWS), cdiv(cols, BLOCK)).
    ``partial[r, j]`` (float32, ``chunks`` per row) = the largest magnitude of row r's
    columns ``j * BLOCK ...``: a maximum, so the chunks give the row's exactly."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1)
    c = j * BLOCK + tl.arange(0, BLOCK)
    row_ok = r < rows
    r64 = r.to(tl.int64)
    mask = row_ok[:, None] & (c < cols)[None, :]
    x = tl.load(x_ptr + r64[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    amax = tl.reduce(tl.abs(x.to(tl.float32)), 1, tl.standard._elementwise_max)
    tl.store(partial_ptr + r64 * chunks + j, amax, mask=row_ok)


@triton.jit(do_not_specialize=["rows"])
def quantize_fp8_tiles_kernel(
    x_ptr,
    partial_ptr,
    out_ptr,
    scale_ptr,
    rows,
    cols,
    stride_x,
    stride_o,
    min_scale,
    CHUNKS: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    E4M3: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Tiled per-token quantization, second kernel: a [ROWS, BLOCK] tile per program, as
    ``quantize_fp8_per_token_kernel`` computes each value, with each row's scale from the
    ``CHUNKS`` partial maxima of ``row_chunk_amax_kernel`` (or of a kernel that made the rows
    and their maxima together). The programs of the first column of tiles store the scales."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_ok = r < rows
    r64 = r.to(tl.int64)
    p = tl.arange(0, CHUNKS_P2)
    part = tl.load(partial_ptr + r64[:, None] * CHUNKS + p[None, :],
                   mask=row_ok[:, None] & (p < CHUNKS)[None, :], other=0.0)  # fmt: skip
    amax = tl.reduce(part, 1, tl.standard._elementwise_max)
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), min_scale)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + r, scale, mask=row_ok)
    recip = tl.math.div_rn(1.0, scale)
    mask = row_ok[:, None] & (c < cols)[None, :]
    x = tl.load(x_ptr + r64[:, None] * stride_x + c[None, :], mask=mask, other=0.0)
    y = _quotient(x.to(tl.float32), scale[:, None], recip[:, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(out_ptr + r64[:, None] * stride_o + c[None, :], _e4m3(y, E4M3), mask=mask)


@triton.jit
def _store_scaled(acc, y_ptr, x_scale_ptr, w_scale_ptr, rn, rm, M, N, stride_ym, mask,
                  SCALED: tl.constexpr):  # fmt: skip
    """``y[rm, rn] = acc.T * x_scale[rm] * w_scale[rn]`` in y's dtype (acc is [rn, rm]);
    without SCALED, ``acc.T``."""
    if SCALED:
        acc = acc * tl.load(w_scale_ptr + rn % N)[:, None]
        acc = acc * tl.load(x_scale_ptr + rm % M)[None, :]
    y = y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round(v, like_ptr, ROUND: tl.constexpr):
    """``v`` (fp32) rounded to the element type of ``like_ptr``, returned in fp32: the fused
    SiLU kernel's helper (``pagedattn_kernels.fused.triton_kernels._round``; repeated because
    a kernel module holds its own helpers). 1: the cast; 2: bfloat16's round-to-nearest-even
    on the bits (the interpreter's cast truncates); 0: none (float32)."""
    if ROUND == 1:
        return v.to(like_ptr.dtype.element_ty).to(tl.float32)
    elif ROUND == 2:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return v


@triton.jit
def _store_silu_and_mul(acc, y_ptr, amax_ptr, x_scale_ptr, w_scale_ptr, w_rows, rm, M,
                        stride_ym, pid_n, inter, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                        SCALED: tl.constexpr, ROUND: tl.constexpr, LIBDEVICE: tl.constexpr,
                        AMAX: tl.constexpr):  # fmt: skip
    """GATED's epilogue: ``acc [2 HALF, BLOCK_M]`` holds the gate rows ``j`` (its first HALF
    rows) and the up rows ``inter + j`` (the next HALF) of this program's HALF products ``j``
    (weight rows ``w_rows``).
    Each is scaled and rounded to y's dtype exactly as ``_store_scaled`` stores it, then
    ``y[t, j] = silu(gate) * up`` exactly as ``silu_and_mul_kernel`` computes it from those
    stored values (``g / (1 + expf(-g))``, rounded to the dtype before and after the product).
    AMAX: each token's largest |y| over the tile goes to ``amax[t, pid_n]``, the maxima
    ``quantize_fp8_tiles_kernel`` takes."""
    j = pid_n * HALF + tl.arange(0, HALF)
    j_ok = j < inter
    if SCALED:
        acc = acc * tl.load(w_scale_ptr + w_rows)[:, None]
        acc = acc * tl.load(x_scale_ptr + rm % M)[None, :]
    acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    g, u = tl.split(tl.permute(tl.reshape(acc, [2, HALF, BLOCK_M]), (1, 2, 0)))
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = _round(tl.math.div_rn(g, 1.0 + e), y_ptr, ROUND)
    y = _round(s * u, y_ptr, ROUND)
    mask = j_ok[:, None] & (rm < M)[None, :]
    out = y_ptr + rm.to(tl.int64)[None, :] * stride_ym + j[:, None]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask)
    if AMAX:
        amax = tl.reduce(tl.where(j_ok[:, None], tl.abs(y), 0.0), 0, tl.standard._elementwise_max)
        tl.store(amax_ptr + rm.to(tl.int64) * tl.num_programs(1) + pid_n, amax, mask=rm < M)


# The row count and what follows from it change with every decode batch, the split count
# with the shape: never specialized on (a serving run would stall to compile a variant at
# each first "1" or multiple of 16).
@triton.jit(do_not_specialize=["M", "splits"])
def fp8_matmul_kernel(
    y_ptr,
    part_ptr,
    counter_ptr,
    xq_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    M,
    N,
    K,
    k_chunk,
    splits,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE_HERE: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PROMOTE: tl.constexpr,
    PDL: tl.constexpr = False,
    SCALED: tl.constexpr = True,
    GATED: tl.constexpr = False,
    ROUND: tl.constexpr = 0,
    LIBDEVICE: tl.constexpr = False,
    AMAX: tl.constexpr = False,
):
    """``y[M, N] = (xq @ Wq.T) * x_scale[m] * w_scale[n]``, computed as its transpose with the
    operands swapped: ``acc[BLOCK_N, BLOCK_M] = Wq tile [BLOCK_N, BLOCK_K] @ xq tile.T
    [BLOCK_K, BLOCK_M]``. Grid: (M blocks, N blocks, splits); split ``s`` sums K range
    [s * k_chunk, + k_chunk) (k_chunk a multiple of BLOCK_K). The M blocks come first so that
    past one block of tokens (129 rows and more) the programs that read the same weight tile
    launch side by side, and all but the first find it in L2. With N first they were a whole
    grid row apart, and a weight larger than L2 (gate/up's 117 MB or down's 59 MB on
    Llama-3-8B, against an H200's 50 MB) streamed from memory once per block of tokens.

    Why swapped: at decode batch sizes M (the tokens) is 1-64, while a tensor-core tile's M
    side is 64 on sm_90's wgmma (cuBLAS's fp8 kernels take 128 rows there). The weight rows
    fill that side, the few tokens the N side (16 at least: one token wastes 15/16 of the
    multiplies, which cost nothing while the weights stream in). Both operands stay e4m3 and
    K-contiguous, as wgmma takes fp8: no conversion in the loop (sm_90 offline compile: QGMMA,
    about 90 instructions per 16 KB of weights), and the weights are read once, at half
    bf16's bytes.

    Weight rows past N re-read valid ones (``% N``: no mask on the weight loads) and are not
    stored. Token rows past M are masked out of the loads (zeros, no memory read): re-reading
    valid rows (``% M``) made every one of a tile's 16 columns load the same row when M = 1,
    and on an H200 (CUDA graphs) a Llama-3-8B layer's four matmuls took 75.3 us at 1 row
    against 66.0 at 2, 63.0 at 4 and 62.8 at 16 (``scripts/fp8_weight_only_gemm.py --m 2 1
    2 1 4 16``, d6eeae7); masked, 61.3 / 61.4 / 61.8 / 62.6 at 1 / 2 / 4 / 16 (dd684d9).

    SPLIT: the raw fp32 sums go to ``part [splits, M, N]``; then either
    ``fp8_matmul_reduce_kernel`` finishes, or (MERGE_HERE) the tile's last split to finish
    does: each split counts itself in ``counter_ptr`` (one int32 per tile, zero between
    calls), and the one that sees ``splits - 1`` before it sums the partials in split order
    (the same result on every run), stores y and zeroes the count again. That saves a launch
    per matmul, about 3 us each in a decode step of 16 sequences on an H200 (128 of them).
    Without SPLIT: scaled and stored in y's dtype. UPCAST: the interpreter, which has no fp8
    dot: float32 operands, which hold e4m3 values exactly. PROMOTE: add each BLOCK_K slice's
    fp8 MMA sum into the float32 accumulator (exact accumulation); without it the MMA
    accumulates in its own narrower format throughout (cuBLAS's "fast accumulation").
    SCALED False: the same kernel on 16-bit operands (``matmul_16bit`` in the launcher:
    ``y = x @ W.T``, no scales, no PROMOTE), for timing the swapped tiles against cuBLAS's
    bf16 matmuls at decode batch sizes.

    GATED (no SPLIT): W is a fused gate/up projection ``[2 I, K]`` (N = 2 I) and the kernel
    stores SwiGLU's activation ``y [M, I] = silu(gate) * up`` instead of the projection
    (``_store_silu_and_mul``; ROUND and LIBDEVICE as ``silu_and_mul_kernel``'s, AMAX: also
    each tile's largest magnitude per token into ``part_ptr [M, N blocks]``). A program's
    BLOCK_N weight rows are the gate rows of its BLOCK_N / 2 products and their up rows, so
    each product's two factors meet in one tile: the activation needs no kernel of its own
    and its input, twice its size, is never written. It lets the next kernel launch at its
    end, not its start (see there)."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        if not GATED:
            gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    if GATED:  # gate rows j, then up rows inter + j, of this program's BLOCK_N / 2 products
        inter = N // 2
        half = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        up = tl.arange(0, BLOCK_N) // (BLOCK_N // 2)
        w_rows = up * inter + (pid_n * (BLOCK_N // 2) + half) % inter
    else:
        w_rows = rn % N
    w_ptrs = w_ptr + w_rows.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    x_ptrs = xq_ptr + rm.to(tl.int64)[None, :] * stride_xm + rk[:, None]  # [K, M] view
    row_ok = (rm < M)[None, :]
    k_lo = pid_k * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    acc = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k)
            x = tl.load(x_ptrs + k, mask=row_ok, other=0.0)
        else:
            w = tl.load(w_ptrs + k, mask=(k + rk < K)[None, :], other=0.0)
            x = tl.load(x_ptrs + k, mask=(k + rk < K)[:, None] & row_ok, other=0.0)
        if UPCAST:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        elif PROMOTE:
            # Hopper's fp8 MMA keeps fewer bits than fp32 while it accumulates: promote each
            # BLOCK_K slice into the fp32 accumulator (as cuBLAS does without fast accumulation).
            # Unpromoted, an H200 was 1.1-2.75x past the exact-accumulation bound at K = 4096.
            acc = tl.dot(w, x, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(w, x, acc)
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    if GATED:
        _store_silu_and_mul(acc, y_ptr, part_ptr, x_scale_ptr, w_scale_ptr, w_rows, rm, M,
                            stride_ym, pid_n, N // 2, BLOCK_N // 2, BLOCK_M, SCALED, ROUND,
                            LIBDEVICE, AMAX)  # fmt: skip
        if PDL:
            # The next kernel launches once every program got here, not at their start: then
            # the down projection (up to 160 KB of shared memory a program) started while
            # this kernel's second wave ran, and on an H200 a layer's gate/up, activation and
            # down took 95 us at 8 rows against 90 for the three kernels apart
            # (scripts/gate_up_silu_bench.py --chain).
            gdc_launch_dependents()
    elif not SPLIT:
        _store_scaled(acc, y_ptr, x_scale_ptr, w_scale_ptr, rn, rm, M, N, stride_ym, mask,
                      SCALED)  # fmt: skip
    else:
        part = part_ptr + rm[None, :] * N + rn[:, None]
        tl.store(part + pid_k * M * N, acc, mask=mask)
        if MERGE_HERE:
            tl.debug_barrier()  # every thread's partial is stored before the count moves
            counter = counter_ptr + pid_n * tl.num_programs(0) + pid_m
            if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
                total = tl.full([BLOCK_N, BLOCK_M], 0.0, tl.float32)
                for s in range(splits):  # from L2 (".cg"): other SMs wrote them
                    total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                _store_scaled(total, y_ptr, x_scale_ptr, w_scale_ptr, rn, rm, M, N, stride_ym,
                              mask, SCALED)  # fmt: skip
                tl.atomic_xchg(counter, 0)


@triton.jit(do_not_specialize=["numel", "splits"])
def fp8_matmul_reduce_kernel(y_ptr, part_ptr, x_scale_ptr, w_scale_ptr, numel, N, splits,
                             stride_ym, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                             SCALED: tl.constexpr = True):  # fmt: skip
    """``y[m, n] = (sum over splits of part[s, m, n]) * w_scale[n] * x_scale[m]``, the splits
    of ``fp8_matmul_kernel`` summed in a fixed order (the same result on every run); without
    SCALED, the sum alone."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if SCALED:
        acc = acc * tl.load(w_scale_ptr + n, mask=mask, other=0.0)
        acc = acc * tl.load(x_scale_ptr + m, mask=mask, other=0.0)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)
