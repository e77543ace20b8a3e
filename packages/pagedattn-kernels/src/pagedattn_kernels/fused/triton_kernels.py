"""Triton kernels for a decoder layer's elementwise work (device code only; the launchers are
in ``triton_launch``, the public ops in ``ops``): RMSNorm with the residual add fused in,
SiLU-and-multiply, rotary embedding (alone, or with the new keys and values written into the
paged KV cache in the same pass); the first two can also quantize their output per token to
fp8 (``QUANT``), the input of the fp8 linear layer that follows.

Each kernel reproduces the rounding sequence of the unfused torch composition it replaces
(Hugging Face's Llama: ``models/layers.py``), not just its mathematical value, so that a model
gives the same tokens with and without them:

- everything is computed in fp32 and every intermediate that torch materializes in the model
  dtype is rounded to that dtype at the same point (``_round``), e.g. ``h.to(dtype)`` before
  the multiplication by the norm weight, or ``x * cos`` before it is added to
  ``rotate_half(x) * sin``. (torch computes half/bfloat16 arithmetic in fp32 and rounds each
  result, which is what these kernels do.)
- transcendentals come from libdevice (``expf``, ``cosf``, ``sinf``: the CUDA math library
  functions torch's own kernels call), not from Triton's defaults (``tl.exp`` is
  ``ex2.approx``); the SiLU division is IEEE (``div_rn``; Triton's ``/`` is ``div.full``,
  2 ulp).
- the launchers pass ``enable_fp_fusion=False``: no multiply and add get contracted into one
  FMA where torch, running them as separate kernels, rounds twice.

What remains different from torch is the order in which the RMSNorm sum of squares is added up
(torch's reduction kernel has its own tree), so the norm agrees to the last bit of the model
dtype almost always, not always. See the docstrings in ``ops`` for each op's exactness.

Under Triton's interpreter (tests on CPU) two things change, both selected by constexpr flags:
libdevice does not exist there (``LIBDEVICE=False``: numpy's exp/cos/sin instead), and its
fp32 -> bfloat16 cast truncates instead of rounding to nearest even, so bfloat16 rounding is
done in integer arithmetic (``ROUND == 2``; bit-identical to round-to-nearest-even).

Like ``attention/triton_kernels.py``, this file is loaded twice when both compiled and
interpreted kernels are needed (``pagedattn_kernels.common.load_kernels``); it calls only Triton
builtins and the jit helpers defined here, and reduces with ``tl.reduce`` and the standard
combine functions.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# ``ROUND``: how a kernel rounds an fp32 value to the model dtype.
ROUND_NONE = 0  # the model dtype is fp32
ROUND_CAST = 1  # float16, or bfloat16 when compiled: a round-to-nearest-even cast
ROUND_BF16_BITS = 2  # bfloat16 under the interpreter, whose cast truncates


@triton.jit
def _round(v, like_ptr, ROUND: tl.constexpr):
    """``v`` (fp32) rounded to the element type of ``like_ptr``, returned in fp32."""
    if ROUND == 1:
        return v.to(like_ptr.dtype.element_ty).to(tl.float32)
    elif ROUND == 2:
        # Round to nearest even on the 16 bits that bfloat16 drops (NaN stays NaN unless its
        # payload lives only in those bits; the models never produce NaN).
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        return v


@triton.jit
def _quotient(x, scale, recip):
    """fp32 ``x / scale`` correctly rounded from ``recip = div_rn(1, scale)``: the
    quantization kernel's helper (``pagedattn_kernels.quant.triton_kernels._quotient`` says
    why it is exact; repeated because a kernel module holds its own helpers)."""
    q0 = x * recip
    q1 = tl.fma(tl.fma(-q0, scale, x), recip, q0)
    return tl.where(tl.abs(q0) <= 448.0, q1, q0)


@triton.jit
def _e4m3(y, E4M3: tl.constexpr):
    """fp32 ``y`` (already within +-448) to e4m3, nearest value, ties to even: the hardware
    conversion (E4M3 2) or integer operations (1), the quantization kernel's encoder
    (``pagedattn_kernels.quant.triton_kernels._e4m3``)."""
    if E4M3 == 2:
        return y.to(tl.float8e4nv)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    steps = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    subnormal = steps.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag < 0x3C800000, subnormal, normal) | sign
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _store_fp8_rows(y, q_ptr, scale_ptr, rows, row_ok, r64, cols, mask, stride_q, min_scale,
                    E4M3: tl.constexpr):  # fmt: skip
    """Quantize whole rows ``y [ROWS, BLOCK]`` (fp32 holding model-dtype values; zeros past
    the row's end) per token to e4m3, as ``quantize_fp8_per_token`` does to the same values:
    ``scale = max(amax / 448, min_scale)`` (IEEE division), ``q = e4m3(clamp(y / scale))``
    (the quotient correctly rounded, ``_quotient``)."""
    amax = tl.reduce(tl.abs(y), 1, tl.standard._elementwise_max)
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), min_scale)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    recip = tl.math.div_rn(1.0, scale)
    v = _quotient(y, scale[:, None], recip[:, None])
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(q_ptr + r64 * stride_q + cols[None, :], _e4m3(v, E4M3), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def rms_norm_kernel(
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    num_rows,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    inv_hidden,
    eps,
    q_ptr,
    scale_ptr,
    stride_q,
    min_scale,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    ADD: tl.constexpr,
    ROUND: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """ROWS rows per program, each whole (BLOCK_H >= HIDDEN): read once, written once.

    ADD: ``s = x + residual`` (rounded to the dtype) goes to ``residual_out`` and is normed;
    otherwise ``x`` is normed. Then, as Hugging Face's LlamaRMSNorm:
    ``weight * (s * rsqrt(mean(s^2) + eps)).to(dtype)``; the mean is ``sum * fl32(1/HIDDEN)``
    as torch's CUDA mean computes it. All loads precede the stores, so ``out`` may be ``x`` and
    ``residual_out`` may be ``residual`` (in place).

    QUANT (1 or 2, the e4m3 encoder: ``_e4m3``'s E4M3): the normed rows are not stored in the
    model dtype but quantized per token to e4m3 (``_store_fp8_rows``: ``q_ptr`` and the scales
    at ``scale_ptr``), the input of an fp8 linear layer; ``out_ptr`` only gives the model
    dtype for the roundings.
    """
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < HIDDEN
    row_ok = rows < num_rows
    mask = row_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:
        res = tl.load(residual_ptr + r64 * stride_r + cols[None, :], mask=mask, other=0.0)
        x = _round(x + res.to(tl.float32), residual_out_ptr, ROUND)
        tl.store(
            residual_out_ptr + r64 * stride_ro + cols[None, :],
            x.to(residual_out_ptr.dtype.element_ty),
            mask=mask,
        )
    mean_sq = tl.reduce(x * x, 1, tl.standard._sum_combine) * inv_hidden
    inv_rms = tl.math.rsqrt(mean_sq + eps)
    h = _round(x * inv_rms[:, None], out_ptr, ROUND)
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = _round(w[None, :] * h, out_ptr, ROUND)
    if QUANT:
        _store_fp8_rows(y, q_ptr, scale_ptr, rows, row_ok, r64, cols, mask, stride_q, min_scale,
                        QUANT)  # fmt: skip
    else:
        tl.store(out_ptr + r64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip


@triton.jit
def _silu_mul(g, u, like_ptr, ROUND: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``silu(g) * u`` as torch computes it, in fp32 holding model-dtype values: ``g / (1 +
    expf(-g))`` rounded to the dtype of ``like_ptr``, then the product, rounded again."""
    g = g.to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = _round(tl.math.div_rn(g, 1.0 + e), like_ptr, ROUND)
    return _round(s * u.to(tl.float32), like_ptr, ROUND)


@triton.jit(do_not_specialize=["num_rows"])
def silu_and_mul_kernel(
    out_ptr,
    x_ptr,
    num_rows,
    stride_x,
    stride_o,
    q_ptr,
    scale_ptr,
    stride_q,
    min_scale,
    partial_ptr,
    chunks,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    ROUND: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    QUANT: tl.constexpr,
    AMAX: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``out[t, i] = silu(x[t, i]) * x[t, INTER + i]`` for a [ROWS, BLOCK] tile; silu as
    torch computes it, ``g / (1 + expf(-g))``, rounded to the dtype before the product.

    QUANT (1 or 2 as ``rms_norm_kernel``'s; BLOCK >= INTER: a program holds whole rows): the
    products are quantized per token to e4m3 (``_store_fp8_rows``) instead of stored, the
    input of an fp8 down projection; ``out_ptr`` only gives the model dtype for the roundings.

    AMAX (tiled fp8 output): the products are stored, and each row's largest magnitude in the
    tile goes to ``partial[row, program_id(1)]`` (``chunks`` per row), for
    ``quantize_fp8_tiles_kernel`` to quantize them without another pass for the scales."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < INTER)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    gate_ptrs = x_ptr + r64 * stride_x + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0)
    u = tl.load(gate_ptrs + INTER, mask=mask, other=0.0)
    y = _silu_mul(g, u, out_ptr, ROUND, LIBDEVICE)
    if QUANT:
        _store_fp8_rows(y, q_ptr, scale_ptr, rows, row_ok, r64, cols, mask, stride_q, min_scale,
                        QUANT)  # fmt: skip
    else:
        tl.store(out_ptr + r64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
        if AMAX:
            amax = tl.reduce(tl.abs(y), 1, tl.standard._elementwise_max)
            tl.store(partial_ptr + rows.to(tl.int64) * chunks + tl.program_id(1), amax,
                     mask=row_ok)  # fmt: skip


@triton.jit(do_not_specialize=["num_rows"])
def silu_and_mul_fp8_rows_kernel(
    x_ptr,
    scratch_ptr,
    q_ptr,
    scale_ptr,
    num_rows,
    stride_x,
    stride_q,
    min_scale,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    E4M3: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """SiLU-and-multiply quantized per token to e4m3, whole rows in one kernel, each row in
    two passes of BLOCK columns: the products (``_silu_mul``) go to this program's scratch
    row (``scratch_ptr [programs, INTER]``, the model dtype) while their largest magnitude is
    taken; then they are read back, quantized with the row's scale and stored, as
    ``_store_fp8_rows`` does. The same bits as ``silu_and_mul_kernel`` with QUANT, or with
    AMAX then ``quantize_fp8_tiles_kernel``.

    Why: the scale needs the whole row's maximum before the first value can be quantized. A
    program holding a row of 14,336 in registers runs one program an SM, whose load, SiLU
    and store phases do not overlap; two tiled kernels instead write every product to memory
    and read it back, each in a kernel of its own. Here the round trip is to a scratch row that
    the program reads back moments after writing it, mostly from L2, and reuses for every row
    it takes (program p takes rows p, p + programs, ...); the programs are small enough to run
    several an SM, so one's SiLU overlaps another's loads. On an H200 at 16,384 rows (a
    prefill pass) 473 against 655 us for the tiled pair (``triton_launch``'s
    ``SILU_FP8_TWO_PASS_MIN_ROWS``)."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    scratch = scratch_ptr + pid.to(tl.int64) * INTER
    for row in range(pid.to(tl.int64), num_rows, tl.num_programs(0)):  # 64-bit offsets
        gate = x_ptr + row * stride_x
        amax = tl.full([BLOCK], 0.0, tl.float32)
        for c in range(0, INTER, BLOCK):
            ok = c + cols < INTER
            g = tl.load(gate + c + cols, mask=ok, other=0.0)
            u = tl.load(gate + INTER + c + cols, mask=ok, other=0.0)
            y = _silu_mul(g, u, scratch_ptr, ROUND, LIBDEVICE)
            tl.store(scratch + c + cols, y.to(scratch_ptr.dtype.element_ty), mask=ok)
            amax = tl.maximum(amax, tl.abs(y))
        scale = tl.maximum(
            tl.math.div_rn(tl.reduce(amax, 0, tl.standard._elementwise_max), 448.0), min_scale
        )
        tl.store(scale_ptr + row, scale)
        recip = tl.math.div_rn(1.0, scale)
        tl.debug_barrier()  # the scratch row written by every thread before any reads it back
        out = q_ptr + row * stride_q
        for c in range(0, INTER, BLOCK):
            ok = c + cols < INTER
            y = tl.load(scratch + c + cols, mask=ok, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(_quotient(y, scale, recip), -448.0), 448.0)
            tl.store(out + c + cols, _e4m3(v, E4M3), mask=ok)
        tl.debug_barrier()  # read back by every thread before the next row overwrites it


@triton.jit
def _token_angles(positions_ptr, inv_freq_ptr, num_tokens, like_ptr, ROWS: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, ROUND: tl.constexpr,
                  LIBDEVICE: tl.constexpr):  # fmt: skip
    """This program's ROWS tokens (int64 indices, in-range mask), the rotary dims (index, mask)
    and each token's cos and sin ``[ROWS, HALF_PAD]``, computed once per token and shared by
    all its heads exactly as ``RotaryEmbedding.cos_sin`` does: ``fl32(float(position) *
    inv_freq)``, then ``cosf``/``sinf`` rounded to the dtype. No table: any position works."""
    toks = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    tok_ok = toks < num_tokens
    t64 = toks.to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    pos = tl.load(positions_ptr + t64, mask=tok_ok, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + d, mask=d_ok, other=0.0)
    angle = pos[:, None] * inv_freq[None, :]
    if LIBDEVICE:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    return t64, tok_ok, d, d_ok, _round(cos, like_ptr, ROUND), _round(sin, like_ptr, ROUND)


@triton.jit
def _rotate_heads(
    ptr,
    t64,
    tok_ok,
    stride_t,
    stride_h,
    cos,
    sin,
    d,
    d_ok,
    num_heads,
    BLOCK_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Rotate the first ``num_heads`` heads at ``ptr`` of ROWS tokens in place (all of a
    token's heads, or a split grid's group: ``ptr`` then points at its first head):
    ``[x1, x2] -> [x1 c - x2 s, x2 c + x1 s]`` with each product and the sum rounded to the
    dtype, as ``x * cos + rotate_half(x) * sin`` rounds them (``rotate_half`` negates exactly,
    so ``+ (-x2) s`` is ``- x2 s``). Returns the two rotated halves
    ``[ROWS, BLOCK_HEADS, HALF_PAD]`` in the dtype, as stored."""
    h = tl.arange(0, BLOCK_HEADS)
    mask = tok_ok[:, None, None] & (h < num_heads)[None, :, None] & d_ok[None, None, :]
    lo = ptr + t64[:, None, None] * stride_t + h[None, :, None] * stride_h + d[None, None, :]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[:, None, :]
    s = sin[:, None, :]
    out1 = _round(_round(x1 * c, ptr, ROUND) - _round(x2 * s, ptr, ROUND), ptr, ROUND)
    out2 = _round(_round(x2 * c, ptr, ROUND) + _round(x1 * s, ptr, ROUND), ptr, ROUND)
    out1 = out1.to(ptr.dtype.element_ty)
    out2 = out2.to(ptr.dtype.element_ty)
    tl.store(lo, out1, mask=mask)
    tl.store(lo + HALF, out2, mask=mask)
    return out1, out2


@triton.jit(do_not_specialize=["num_tokens"])
def rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    inv_freq_ptr,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_KEY: tl.constexpr,
    ROUND: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    HEAD_SPLITS: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """NeoX ("rotate half") RoPE in place on every query and key head of ROWS tokens (the
    angles: ``_token_angles``).

    HEAD_SPLITS 1: a program rotates all of its tokens' heads (BLOCK_QH, BLOCK_KH: every
    query and key head, padded to a power of two). Otherwise the grid's second axis splits
    each token's heads over HEAD_SPLITS programs: the first ``cdiv(NUM_Q_HEADS, BLOCK_QH)``
    rotate BLOCK_QH query heads each, the rest BLOCK_KH key heads each (``_head_group``);
    each program computes its tokens' angles itself. The same values either way."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    t64, tok_ok, d, d_ok, cos, sin = _token_angles(positions_ptr, inv_freq_ptr, num_tokens, q_ptr,
                                                   ROWS, HALF, HALF_PAD, ROUND, LIBDEVICE)  # fmt: skip
    if HEAD_SPLITS == 1:
        _rotate_heads(q_ptr, t64, tok_ok, stride_qt, stride_qh, cos, sin, d, d_ok,
                      NUM_Q_HEADS, BLOCK_QH, HALF, ROUND)  # fmt: skip
        if HAS_KEY:
            _rotate_heads(k_ptr, t64, tok_ok, stride_kt, stride_kh, cos, sin, d, d_ok,
                          NUM_K_HEADS, BLOCK_KH, HALF, ROUND)  # fmt: skip
    else:
        is_query, first = _head_group(NUM_Q_HEADS, NUM_K_HEADS * HAS_KEY, BLOCK_QH, BLOCK_KH,
                                      HEAD_SPLITS)  # fmt: skip
        if is_query:
            _rotate_heads(q_ptr + first * stride_qh, t64, tok_ok, stride_qt, stride_qh, cos,
                          sin, d, d_ok, NUM_Q_HEADS - first, BLOCK_QH, HALF, ROUND)  # fmt: skip
        else:
            _rotate_heads(k_ptr + first * stride_kh, t64, tok_ok, stride_kt, stride_kh, cos,
                          sin, d, d_ok, NUM_K_HEADS - first, BLOCK_KH, HALF, ROUND)  # fmt: skip


@triton.jit
def _head_group(NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr,
                BLOCK_KH: tl.constexpr, HEAD_SPLITS: tl.constexpr):  # fmt: skip
    """This program's heads in a grid split over heads (``program_id(1)``): whether they are
    query heads, and the first of them; programs ``0 .. cdiv(NUM_Q_HEADS, BLOCK_QH) - 1``
    take BLOCK_QH query heads each, the rest BLOCK_KH key heads each (NUM_K_HEADS 0: no key
    programs). The launcher sizes the grid's second axis to exactly those programs."""
    Q_SPLITS: tl.constexpr = (NUM_Q_HEADS + BLOCK_QH - 1) // BLOCK_QH
    tl.static_assert(HEAD_SPLITS == Q_SPLITS + (NUM_K_HEADS + BLOCK_KH - 1) // BLOCK_KH)
    part = tl.program_id(1)
    is_query = part < Q_SPLITS
    first = tl.where(is_query, part * BLOCK_QH, (part - Q_SPLITS) * BLOCK_KH)
    return is_query, first


@triton.jit
def _cache_scale(scale_ptr, KV_FP8: tl.constexpr):
    """(scale, 1 / scale) of an fp8 cache, loaded once per program for ``_store_to_cache``;
    (1.0, 1.0), never read, for a 16-bit cache (whose scale pointer is the cache itself)."""
    scale = 1.0
    recip = 1.0
    if KV_FP8:
        scale = tl.load(scale_ptr)
        recip = tl.math.div_rn(1.0, scale)
    return scale, recip


@triton.jit
def _store_to_cache(ptr, x, mask, scale, recip, KV_FP8: tl.constexpr, E4M3: tl.constexpr):
    """Store ``x`` (model dtype) as the cache holds it: itself, or (KV_FP8) e4m3 of
    ``clamp(x / scale, -448, 448)`` (``recip``: 1 / scale, see ``_cache_scale``), as
    ``reshape_and_cache_kernel`` writes it."""
    if KV_FP8:
        y = _quotient(x.to(tl.float32), scale, recip)
        tl.store(ptr, _e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0), E4M3), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _cache_heads(
    k1,
    k2,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    t64,
    tok_ok,
    d,
    d_ok,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    num_heads,
    BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    E4M3: tl.constexpr,
):
    """Write the first ``num_heads`` rotated key heads (``k1``, ``k2``: their halves, in
    registers) and value heads of ROWS tokens into each token's cache slot (slot < 0: no
    write), quantized on the way for an fp8 cache. ``v_ptr`` and the cache pointers point at
    the first of these heads (a split grid's group) or at head 0."""
    slot = tl.load(slot_ptr + t64, mask=tok_ok, other=-1).to(tl.int64)
    write = tok_ok & (slot >= 0)
    slot = tl.where(write, slot, 0)
    h = tl.arange(0, BLOCK_KH)
    mask = write[:, None, None] & (h < num_heads)[None, :, None] & d_ok[None, None, :]
    block = (slot // BLOCK_SIZE)[:, None, None]
    offset = (slot % BLOCK_SIZE)[:, None, None]
    hd = h[None, :, None]
    kc = key_cache_ptr + block * stride_kc_block + offset * stride_kc_tok + hd * stride_kc_head
    kc += d[None, None, :]
    k_scale, k_recip = _cache_scale(k_scale_ptr, KV_FP8)
    _store_to_cache(kc, k1, mask, k_scale, k_recip, KV_FP8, E4M3)
    _store_to_cache(kc + HALF, k2, mask, k_scale, k_recip, KV_FP8, E4M3)
    v = v_ptr + t64[:, None, None] * stride_vt + hd * stride_vh + d[None, None, :]
    vc = value_cache_ptr + block * stride_vc_block + offset * stride_vc_tok + hd * stride_vc_head
    vc += d[None, None, :]
    v1 = tl.load(v, mask=mask)
    v2 = tl.load(v + HALF, mask=mask)
    v_scale, v_recip = _cache_scale(v_scale_ptr, KV_FP8)
    _store_to_cache(vc, v1, mask, v_scale, v_recip, KV_FP8, E4M3)
    _store_to_cache(vc + HALF, v2, mask, v_scale, v_recip, KV_FP8, E4M3)


@triton.jit(do_not_specialize=["num_tokens", "k_scale_ptr", "v_scale_ptr"])
def rotary_and_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    inv_freq_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    E4M3: tl.constexpr,
    ROUND: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    HEAD_SPLITS: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """``rotary_kernel`` and ``reshape_and_cache_kernel`` in one pass over ROWS tokens: rotate
    the query and key heads in place, then write the rotated keys (still in registers) and
    the values into each token's cache slot (``_cache_heads``). The same values, in the same
    roundings, as the two kernels one after the other; one launch and one read of the keys
    fewer.

    HEAD_SPLITS as ``rotary_kernel``'s: split, a program takes BLOCK_QH query heads, or
    BLOCK_KH key heads together with their value heads and cache writes."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    t64, tok_ok, d, d_ok, cos, sin = _token_angles(positions_ptr, inv_freq_ptr, num_tokens, q_ptr,
                                                   ROWS, HALF, HALF_PAD, ROUND, LIBDEVICE)  # fmt: skip
    if HEAD_SPLITS == 1:
        _rotate_heads(q_ptr, t64, tok_ok, stride_qt, stride_qh, cos, sin, d, d_ok,
                      NUM_Q_HEADS, BLOCK_QH, HALF, ROUND)  # fmt: skip
        k1, k2 = _rotate_heads(k_ptr, t64, tok_ok, stride_kt, stride_kh, cos, sin, d, d_ok,
                               NUM_KV_HEADS, BLOCK_KH, HALF, ROUND)  # fmt: skip
        _cache_heads(k1, k2, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, k_scale_ptr,
                     v_scale_ptr, t64, tok_ok, d, d_ok, stride_vt, stride_vh, stride_kc_block,
                     stride_kc_tok, stride_kc_head, stride_vc_block, stride_vc_tok,
                     stride_vc_head, NUM_KV_HEADS, BLOCK_KH, HALF, BLOCK_SIZE, KV_FP8, E4M3)  # fmt: skip
    else:
        is_query, first = _head_group(NUM_Q_HEADS, NUM_KV_HEADS, BLOCK_QH, BLOCK_KH, HEAD_SPLITS)
        if is_query:
            _rotate_heads(q_ptr + first * stride_qh, t64, tok_ok, stride_qt, stride_qh, cos,
                          sin, d, d_ok, NUM_Q_HEADS - first, BLOCK_QH, HALF, ROUND)  # fmt: skip
        else:
            k1, k2 = _rotate_heads(k_ptr + first * stride_kh, t64, tok_ok, stride_kt, stride_kh,
                                   cos, sin, d, d_ok, NUM_KV_HEADS - first, BLOCK_KH, HALF,
                                   ROUND)  # fmt: skip
            _cache_heads(k1, k2, v_ptr + first * stride_vh, key_cache_ptr + first * stride_kc_head,
                         value_cache_ptr + first * stride_vc_head, slot_ptr, k_scale_ptr,
                         v_scale_ptr, t64, tok_ok, d, d_ok, stride_vt, stride_vh,
                         stride_kc_block, stride_kc_tok, stride_kc_head, stride_vc_block,
                         stride_vc_tok, stride_vc_head, NUM_KV_HEADS - first, BLOCK_KH, HALF,
                         BLOCK_SIZE, KV_FP8, E4M3)  # fmt: skip
