"""The Triton kernel of the quantization op (device code only; the launcher is in
``triton_launch``): per-token fp8 quantization, one program per row.

A program holds a row of up to 16,384 values in registers (a Llama-3-8B row is at most 14,336
wide) and reads it once; a longer row is read twice, a chunk at a time: once for the largest
magnitude, once to divide and store (the second read mostly from L2).

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
):
    """Grid: (rows,). ``scale = max(amax / 448, min_scale)``; ``out = e4m3(clamp(x / scale))``.

    ONE_PASS (BLOCK >= cols): the row stays in registers between the largest magnitude and
    the division, so it is read once. ``cols`` and the strides are specialized on (a model
    has a few widths): unknown to be multiples of 16, they made every load and store one
    element wide (sm_90 SASS: LDG.E.U16 and STG.E.U8 per value)."""
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
