"""The Triton kernel of the prefetch op (device code only; the launcher is in
``triton_launch``).

``prefetch_l2_kernel``: each thread takes one chunk of ``CHUNK`` bytes of the range (the last
one shorter) and issues one ``cp.async.bulk.prefetch.L2.global`` for it: a request that the
SM's copy engine (TMA) turns into L2 fills from HBM, with no register, no shared memory and no
wait for the data. So the kernel ends about as soon as its requests are issued, and the bytes
keep streaming into L2 while the kernels after it run. With ``EVICT_LAST`` the lines carry
L2's ``evict_last`` priority (a ``createpolicy`` cache policy): lines of normal priority, such
as the KV cache that attention streams through, are evicted before them.

``RECORD`` writes each chunk's (start, size) instead of, or as well as, issuing it: the
interpreter, which has no inline assembly and no L2, runs the kernel that way, so the chunking
is tested on the CPU too.

Like every kernel module here, this file is loaded twice when both compiled and interpreted
kernels are needed and calls only Triton builtins (see ``attention/triton_kernels.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents


# The byte count changes with every tensor prefetched: never specialized on.
@triton.jit(do_not_specialize=["nbytes"])
def prefetch_l2_kernel(
    base_ptr,
    record_ptr,
    nbytes,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    ISSUE: tl.constexpr,
    EVICT_LAST: tl.constexpr,
    RECORD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Chunks ``[pid * BLOCK, + BLOCK)`` of the ``nbytes`` bytes at ``base_ptr`` (uint8, 16-byte
    aligned, ``nbytes`` a multiple of 16, as ``cp.async.bulk`` requires)."""
    if PDL:  # reads nothing another kernel writes: no wait, only let the next one launch
        gdc_launch_dependents()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = i.to(tl.int64) * CHUNK
    ok = start < nbytes
    size = tl.where(ok, tl.minimum(nbytes - start, CHUNK), 0).to(tl.int32)
    args = [base_ptr + start, size, ok.to(tl.int32)]
    if ISSUE and EVICT_LAST:  # ($0, an output Triton requires, is never written)
        tl.inline_asm_elementwise(
            "{ .reg .pred ok; .reg .b64 policy; setp.ne.s32 ok, $3, 0; "
            "createpolicy.fractional.L2::evict_last.b64 policy, 1.0; "
            "@ok cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy; }",
            "=r,l,r,r", args, dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    elif ISSUE:
        tl.inline_asm_elementwise(
            "{ .reg .pred ok; setp.ne.s32 ok, $3, 0; "
            "@ok cp.async.bulk.prefetch.L2.global [$1], $2; }",
            "=r,l,r,r", args, dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    if RECORD:
        tl.store(record_ptr + 2 * i, start, mask=ok)
        tl.store(record_ptr + 2 * i + 1, size.to(tl.int64), mask=ok)
