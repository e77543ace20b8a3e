"""The compiled kernels do not recompile when only the batch changes.

Triton compiles one variant per specialisation of its arguments: an integer that is 1, a
multiple of 16 or neither, a pointer that is 16-byte aligned or not. A serving engine slices
block tables and lengths at its number of decode rows and sizes the block table to its longest
sequence, so those change from pass to pass; a variant compiled mid-pass stalled it for about
a second on an H200. Here the same kernels run once, then on batches that differ only in those
ways, and must compile nothing new (and still match the reference).
"""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.testing import TOLERANCE, compiled_kernels, random_paged_batch, rel_error

pytestmark = pytest.mark.gpu


def _batch(seed: int, lens: list[int], q_lens: list[int]):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return random_paged_batch(
        gen, lens, q_lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip


def _mixed(b, nd: int, extra_cols: int):
    """Run a mixed batch the way the engine does: the first `nd` rows (one query token each)
    through the decode kernel, the rest through the prefill kernel, on slices of one block
    table widened by `extra_cols` columns."""
    tables = torch.cat(
        [b.block_tables, b.block_tables.new_zeros(b.block_tables.shape[0], extra_cols)], dim=1
    )
    out = torch.empty_like(b.query)
    pk.paged_decode_attention(
        b.query[:nd], b.key_cache, b.value_cache, tables[:nd], b.seq_lens[:nd],
        max_seq_len=int(b.seq_lens.max()), out=out[:nd],
    )  # fmt: skip
    cu = b.cu_query_lens[nd:] - b.cu_query_lens[nd]
    pk.paged_attention(
        b.query[nd:], b.key_cache, b.value_cache, tables[nd:], b.seq_lens[nd:], cu,
        max_seq_len=int(b.seq_lens.max()), out=out[nd:],
    )  # fmt: skip
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_batches_compile_no_new_variant(seed):
    # warm up: one mixed batch compiles the decode and prefill kernels. Every context here is
    # at most 256 tokens, so flash-decoding never splits (a split is another kernel variant
    # by design, compiled when a decode graph is captured).
    first = _batch(seed, [40] * 8 + [200, 77], [1] * 8 + [200, 20])
    _mixed(first, nd=8, extra_cols=0)
    torch.cuda.synchronize()
    # then: other decode-row counts (unaligned slices), other table widths (16, 17, odd)
    cases = [(3, 1), (5, 2), (1, 5), (7, 9)]
    with compiled_kernels() as compiled:
        for k, (nd, extra) in enumerate(cases):
            lens = [33 + 7 * i for i in range(nd)] + [129, 50 + 16 * k]
            b = _batch(seed + k + 1, lens, [1] * nd + [129, 17])
            out = _mixed(b, nd, extra)
            ref = reference.paged_attention(
                b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.cu_query_lens
            )
            err = rel_error(out, ref)
            assert err < TOLERANCE[torch.bfloat16], f"case {nd, extra}: error {err} (seed {seed})"
        torch.cuda.synchronize()
    assert compiled == [], f"kernels recompiled for a new batch shape: {compiled}"
