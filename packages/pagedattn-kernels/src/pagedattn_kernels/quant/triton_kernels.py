"""The Triton kernel of the quantization op (device code only; the launcher is in
``triton_launch``): per-token fp8 quantization, one program per row.

A program holds a row of up to 16,384 values in registers (a Llama-3-8B row is at most 14,336
wide) and reads it once; a longer row is read twice, a chunk at a time: once for the largest
magnitude, once to divide and store (the second read mostly from L2). The
division is IEEE (``div_rn``) and the e4m3 code (nearest, ties to even, as the torch path
rounds) is computed with integer operations, not cast: the interpreter's cast does not round
every value so (see ``pagedattn_kernels.cache.triton_kernels``, whose ``_e4m3`` is repeated
here because a kernel module holds its own helpers). Like every kernel module here,
this file is loaded twice when both compiled and interpreted kernels are needed and calls only
Triton builtins (see ``attention/triton_kernels.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e4m3(y):
    """fp32 ``y`` (already within +-448) to e4m3, nearest value, ties to even, encoded with
    integer operations and no float-to-fp8 conversion at all. Normal values (|y| >= 2^-6): keep
    3 of the 23 mantissa bits, adding half an ulp plus the tie bit (a carry moves into the
    exponent as it should), and rebias the exponent from 127 to 7. Below (subnormal e4m3,
    steps of 2^-9): |y| * 512 rounded to an integer in float32's own round-to-even, read back
    from the bits of |y| * 512 + 2^23; the code 8 is 2^-6, the first normal value."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960  # 960 == (127 - 7) << 3
    steps = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    subnormal = steps.to(tl.int32, bitcast=True) - 0x4B000000  # 0x4B000000: the bits of 2^23
    code = tl.where(mag < 0x3C800000, subnormal, normal) | sign  # 0x3C800000: 2^-6
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit(do_not_specialize=["cols", "stride_x", "stride_o"])
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
):
    """Grid: (rows,). ``scale = max(amax / 448, min_scale)``; ``out = e4m3(clamp(x / scale))``.

    ONE_PASS (BLOCK >= cols): the row stays in registers between the largest magnitude and
    the division, so it is read once."""
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
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(o_row + c, _e4m3(y), mask=mask)
        return
    amax = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, cols, BLOCK):
        x = tl.load(x_row + start + c, mask=start + c < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(
        tl.math.div_rn(tl.reduce(amax, 0, tl.standard._elementwise_max), 448.0), min_scale
    )
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        mask = start + c < cols
        x = tl.load(x_row + start + c, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(o_row + start + c, _e4m3(y), mask=mask)
