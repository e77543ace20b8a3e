"""The Triton kernels of the sampling ops (device code only; the launchers are in
``triton_launch``): the argmax of each row in two kernels, without atomics, so the result never
depends on the order in which programs run.

``argmax_chunks_kernel``: a program per (row, chunk of ``CHUNK`` columns) holds its chunk in
registers (one load, no loop) and finds its largest value and that value's first column. A
row of one chunk is done there (``DIRECT``: the index goes to the output). Otherwise each
program writes one packed int64 (below) and ``argmax_merge_kernel`` (a program per row) takes
the largest of the row's chunks.

Values are compared as integers, not floats: each value's bits become a key whose integer
order is torch's order (``_key``): negative values below positive ones, -0.0 and 0.0 the same
key, and every NaN, either sign, any payload, one key above +inf. So a float compare's NaN
rules (which differ between the GPU's ``max``, numpy's ``nanmax`` in the interpreter and
torch) never come in, and the largest key's first column is torch's answer: the lowest index
among equal values, the first NaN of a row. The reductions are the standard integer max and
min, which the interpreter runs in numpy.

The packed partial of a chunk: ``key * 2**32 + (2**31 - 1 - column)``. Columns are below
2**31 (checked), so the larger packed value is the larger key, then the lower column: the
merge is one integer max, and the first chunk holding the row's largest key wins.

Like every kernel module here, this file is loaded twice when both compiled and interpreted
kernels are needed and calls only Triton builtins (see ``attention/triton_kernels.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _key(b, SIGN: tl.constexpr, INF_BITS: tl.constexpr):
    """int32 keys in torch's order of the floats whose bits are ``b`` (int32; 16-bit values
    sign-extended), ``SIGN`` the sign bit's value (-2**15 or -2**31), ``INF_BITS`` the bits of
    +inf. A negative value that is not NaN (sign set, magnitude at most inf's) gets minus its
    magnitude, ``SIGN - b`` (so -0.0 gets 0, as 0.0 does); the rest, read unsigned, are
    clamped to ``INF_BITS + 1``: positive values keep their bits (ordered as the magnitudes
    are), every NaN (positive ones above inf's bits, negative ones huge unsigned) gets
    ``INF_BITS + 1``."""
    clamped = tl.minimum(b.to(tl.uint32, bitcast=True), INF_BITS + 1).to(tl.int32, bitcast=True)
    return tl.where(b <= SIGN + INF_BITS, SIGN - b, clamped)


@triton.jit
def argmax_chunks_kernel(
    bits_ptr,
    part_ptr,
    out_ptr,
    cols,
    stride_x,
    stride_o,
    chunks,
    CHUNK: tl.constexpr,
    SIGN: tl.constexpr,
    INF_BITS: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid: (rows, chunks). ``bits_ptr``: the logits viewed as integers of their width (int16
    for bfloat16 and float16, int32 for float32). Columns past the row's end get a key below
    every value's. DIRECT (one chunk a row): ``out[row]`` = the column; else
    ``part[row, chunk]`` = the packed (key, column).
    ``cols`` and the strides are specialized on (a model's constants): a row stride that is a
    multiple of 16 lets the loads vectorize."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = j * CHUNK + tl.arange(0, CHUNK)
    in_row = c < cols
    b = tl.load(bits_ptr + row * stride_x + c, mask=in_row, other=0)
    # Columns past the row: a key below -inf's (-INF_BITS), set on the key rather than through
    # the load's `other`: on an H200 (Triton 3.6) an int16 load's negative `other` (the bits of
    # -inf) came out as a key above every value, and rows of 16-bit logits gave a column past
    # their end.
    key = tl.where(in_row, _key(b.to(tl.int32), SIGN, INF_BITS), -INF_BITS - 1)
    best = tl.reduce(key, 0, tl.standard._elementwise_max)
    first = tl.reduce(tl.where(key == best, c, 2147483647), 0, tl.standard._elementwise_min)
    if DIRECT:
        tl.store(out_ptr + row * stride_o, first.to(tl.int64))
    else:
        packed = (best.to(tl.int64) << 32) | (2147483647 - first).to(tl.int64)
        tl.store(part_ptr + row * chunks + j, packed)


@triton.jit
def argmax_merge_kernel(
    part_ptr,
    out_ptr,
    chunks,
    stride_o,
    CHUNKS_P2: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid: (rows,). ``out[row]`` = the column of the largest of the row's ``chunks`` packed
    partials (``argmax_chunks_kernel``): the largest key, the first chunk that holds it."""
    if PDL:  # programmatic dependent launch (pagedattn_kernels.common.use_pdl)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, CHUNKS_P2)
    part = tl.load(part_ptr + row * chunks + p, mask=p < chunks, other=-9223372036854775807)
    best = tl.reduce(part, 0, tl.standard._elementwise_max)
    # The low 32 bits (below 2**31) are 2**31 - 1 - column.
    first = 2147483647 - best.to(tl.int32)
    tl.store(out_ptr + row * stride_o, first.to(tl.int64))
