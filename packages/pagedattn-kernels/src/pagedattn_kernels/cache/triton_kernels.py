"""The Triton kernels of the cache ops (device code only; the launchers are in
``triton_launch``): writing each new token's K and V into its slot, and copying whole blocks
(copy-on-write) in every layer at once.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` with a unit stride on the
head dim (``copy_blocks_kernel`` sees every layer's blocks as ``[layers, num_blocks, elems]``).

fp8 caches (``KV_FP8``): each K (V) element is stored as e4m3 of ``clamp(x / k_scale, -448,
448)`` (the quotient correctly rounded, then to the nearest e4m3, ties to even), as the torch
path and torch's own cast do: the quotient without a division per element (``_quotient``),
the code from the hardware's conversion where it rounds so (sm_89 and later), else with
integer operations (``_e4m3``, ``E4M3``): Triton's interpreter casts fp32 to fp8 without
carrying a mantissa round-up into the exponent (7.97 becomes 4.0). (H200 failures of the
exactness test once blamed on the compiled cast were float16 infinities in the test's own
data, fixed there.) Both helpers are the quantization kernel's (``quant/triton_kernels.py``
says why they are right), repeated because a kernel module holds its own helpers.

Like every kernel module here, this file is loaded twice when both compiled and interpreted
kernels are needed (``pagedattn_kernels.common.load_kernels``): it must stay free of import-time
side effects and call only Triton builtins (see ``attention/triton_kernels.py`` for why).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _quotient(x, scale, recip):
    """fp32 ``x / scale`` correctly rounded from ``recip = div_rn(1, scale)`` (Markstein; see
    ``pagedattn_kernels.quant.triton_kernels._quotient``); beyond +-448 the uncorrected
    product, which the caller clamps."""
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
def _to_fp8(x, scale, E4M3: tl.constexpr):
    """e4m3 of ``clamp(x / scale, -448, 448)`` (see the module docstring)."""
    y = _quotient(x.to(tl.float32), scale, tl.math.div_rn(1.0, scale))
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return _e4m3(y, E4M3)


@triton.jit(do_not_specialize=["k_scale_ptr", "v_scale_ptr"])
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    E4M3: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per token: copy its K and V (all KV heads) into its slot; slot < 0 skips.
    KV_FP8: quantized to e4m3 with the scales on the way (``E4M3``: how, see ``_e4m3``)."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    if KV_FP8:
        k = _to_fp8(k, tl.load(k_scale_ptr), E4M3)
        v = _to_fp8(v, tl.load(v_scale_ptr), E4M3)
    kc = key_cache_ptr + block * stride_kc_block + offset * stride_kc_tok
    vc = value_cache_ptr + block * stride_vc_block + offset * stride_vc_tok
    tl.store(kc + h[:, None] * stride_kc_head + d[None, :], k, mask=mask)
    tl.store(vc + h[:, None] * stride_vc_head + d[None, :], v, mask=mask)


@triton.jit
def copy_blocks_kernel(
    cache_ptr,
    mapping_ptr,
    stride_layer,
    stride_block,
    BLOCK_ELEMS: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid: (num_pairs, num_layers, chunks per block). Copies one chunk of one block of one
    layer from the pair's source block to its destination block."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    pair = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_ELEMS
    base = cache_ptr + layer * stride_layer
    x = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, x, mask=mask)
