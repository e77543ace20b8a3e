"""paged_attention on mixed batches against the float64 reference: fresh prefills, chunks
that continue a cached prefix (prefix-cache hits, chunked prefill), decode tokens and empty
chunks in one packed batch, for every head size, dtype, block size and GQA ratio."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.testing import (
    ATTENTION_CASES,
    TOLERANCE,
    attention_case_id,
    own_rows,
    poisoned_like,
    random_paged_batch,
    rel_error,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _mixed_batch(block_size: int, full: bool) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens) of a mixed batch."""
    pairs = [
        (23, 23),  # fresh prefill, ragged
        (block_size, block_size),  # fresh prefill, exactly one block
        (40, 9),  # chunk continuing a 31-token cached prefix
        (1, 1),  # decode at context length 1
        (2 * block_size, 1),  # decode, exact blocks
        (30, 0),  # a sequence with no query tokens this step
        (block_size + 3, 5),  # chunk starting mid-block
    ]
    if full:
        pairs += [(1500, 1500), (4100, 700), (9000, 1), (2048, 2048), (300, 64), (3 * 64, 64)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=attention_case_id)
def test_prefill_matches_reference(target, seed, case):
    head_dim, dtype, block_size, group = case
    gen = target.generator(seed)
    num_kv_heads = 4 if target.full else 1
    lens, q_lens = _mixed_batch(block_size, target.full)
    batch = random_paged_batch(
        gen, lens, q_lens, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=target.device,
    )  # fmt: skip
    args = (
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.cu_query_lens,
    )  # fmt: skip
    ref = reference.paged_attention(*args)
    # The host-side hints change no result: give them to every other case.
    hints = {"max_query_len": max(q_lens), "max_seq_len": max(lens)} if block_size != 16 else {}
    out = pk.paged_attention(*args, out=poisoned_like(batch.query), backend=target.backend, **hints)
    err = rel_error(out, ref)
    assert err < TOLERANCE[dtype], f"rel error {err:.2e} with {hints} (seed={seed})"


def test_prefill_single_long_sequence(target, seed):
    """One chunk that spans many query blocks and key tiles, then its continuation chunk,
    must agree with one prefill of the whole sequence (chunked prefill is exact)."""
    gen = target.generator(seed)
    total, first = (3000, 1100) if target.full else (150, 70)
    batch = random_paged_batch(
        gen, [total], [total], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=F32, device=target.device,
    )  # fmt: skip
    kc, vc, bt = batch.key_cache, batch.value_cache, batch.block_tables
    whole = pk.paged_attention(
        batch.query, kc, vc, bt, batch.seq_lens, batch.cu_query_lens, backend=target.backend
    )
    ref = reference.paged_attention(batch.query, kc, vc, bt, batch.seq_lens, batch.cu_query_lens)
    assert rel_error(whole, ref) < TOLERANCE[F32], f"seed={seed}"
    dev = target.device
    parts = []
    for start, stop in ((0, first), (first, total)):
        parts.append(
            pk.paged_attention(
                batch.query[start:stop], kc, vc, bt,
                torch.tensor([stop], dtype=torch.int32, device=dev),
                torch.tensor([0, stop - start], dtype=torch.int32, device=dev),
                backend=target.backend,
            )
        )  # fmt: skip
    chunked = torch.cat(parts)
    assert rel_error(chunked, ref) < TOLERANCE[F32], f"seed={seed}"


@settings(max_examples=15, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 4, 8, 16]),
    group=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_torch_path_any_batch(data, block_size, group, seed):
    """Any mix of (cached prefix, new tokens), any block size: the CPU torch path agrees with
    the reference (hypothesis explores the shapes)."""
    lens = [prefix + new for prefix, new in data]
    q_lens = [new if prefix + new > 0 else 0 for prefix, new in data]
    gen = torch.Generator().manual_seed(seed)
    batch = random_paged_batch(
        gen, lens, q_lens, num_heads=2 * group, num_kv_heads=2, head_dim=16,
        block_size=block_size, dtype=F32,
    )  # fmt: skip
    args = (
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.cu_query_lens,
    )  # fmt: skip
    out = pk.paged_attention(*args, out=poisoned_like(batch.query), backend="torch")
    ref = reference.paged_attention(*args)
    if batch.query.shape[0]:
        assert rel_error(out, ref) < 1e-4


def test_block_order_does_not_matter(target, seed):
    """Moving a sequence's blocks to other physical ids (and updating its table) leaves the
    output unchanged: the kernels follow the table, not the memory order."""
    gen = target.generator(seed)
    lens, q_lens = [70, 33], [20, 1]
    batch = random_paged_batch(
        gen, lens, q_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        dtype=F32, device=target.device, spare_blocks=0,
    )  # fmt: skip
    args = (batch.block_tables, batch.seq_lens, batch.cu_query_lens)
    first = pk.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, *args, backend=target.backend
    )
    num_blocks = batch.key_cache.shape[0]
    perm = torch.randperm(num_blocks, generator=gen, device=gen.device)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(num_blocks, device=perm.device)
    tables = batch.block_tables.clone()
    in_range = tables < num_blocks
    tables[in_range] = inverse[tables[in_range].long()].to(tables.dtype)
    moved = pk.paged_attention(
        batch.query, batch.key_cache[perm], batch.value_cache[perm], tables, *args[1:],
        backend=target.backend,
    )  # fmt: skip
    assert torch.allclose(first, moved, rtol=1e-5, atol=1e-6), f"seed={seed}"


def _batch_with_own_rows(gen: torch.Generator, full: bool, head_dim: int, dtype: torch.dtype):
    """A mixed batch's paged_attention arguments, and its query tokens' own K/V rows."""
    lens, q_lens = _mixed_batch(16, full)
    batch = random_paged_batch(
        gen, lens, q_lens, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16,
        dtype=dtype, device=gen.device,
    )  # fmt: skip
    args = (
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.cu_query_lens,
    )  # fmt: skip
    key = own_rows(batch.key_cache, batch.block_tables, lens, q_lens)
    value = own_rows(batch.value_cache, batch.block_tables, lens, q_lens)
    return args, key, value


@pytest.mark.parametrize("head_dim, dtype", [(64, F32), (80, F32), (128, BF16)])
def test_own_keys_from_the_new_rows(target, seed, head_dim, dtype):
    """Given the step's own keys and values (``key``/``value``), the kernel reads each chunk's
    own keys from those rows and only the earlier context from the cache: the same attention
    (the tiles split at the context's end, so the sums differ only in rounding)."""
    args, key, value = _batch_with_own_rows(target.generator(seed), target.full, head_dim, dtype)
    ref = reference.paged_attention(*args)
    out = pk.paged_attention(*args, out=poisoned_like(args[0]), key=key, value=value,
                             backend=target.backend)  # fmt: skip
    assert rel_error(out, ref) < TOLERANCE[dtype], f"seed={seed}"
    # Keys from a strided view (a fused QKV projection's output): the same.
    wide = torch.zeros(key.shape[0], 3, *key.shape[1:], dtype=dtype, device=target.device)
    wide[:, 1], wide[:, 2] = key, value
    again = pk.paged_attention(*args, key=wide[:, 1], value=wide[:, 2], backend=target.backend)
    assert torch.equal(again, out), f"seed={seed}"


@pytest.mark.parametrize("tma", [False, True])
def test_own_keys_by_pointer_and_by_descriptor(seed, tma):
    """Both ways the Triton kernel reads the new rows (pointers; tensor descriptors, which an
    H200 serves with TMA), run in the interpreter: the reference's attention."""
    from pagedattn_kernels.attention import triton_launch

    args, key, value = _batch_with_own_rows(torch.Generator().manual_seed(seed), False, 32, F32)
    out = poisoned_like(args[0])
    triton_launch.paged_attention(*args, 32**-0.5, out, key=key, value=value, tma=tma)
    assert rel_error(out, reference.paged_attention(*args)) < TOLERANCE[F32], f"seed={seed}"


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda k, v, kc: (k, None), "give both"),
        (lambda k, v, kc: (k[:-1], v[:-1]), "must have shape"),
        (lambda k, v, kc: (k.double(), v.double()), "caches are torch.float32"),
        (lambda k, v, kc: (torch.stack([k, k], -1)[..., 0], v), "unit stride"),
    ],
)  # fmt: skip
def test_bad_new_rows_are_refused(change, match):
    gen = torch.Generator().manual_seed(0)
    batch = random_paged_batch(gen, [20, 7], [20, 3], num_heads=2, num_kv_heads=1, head_dim=16,
                               block_size=8, dtype=F32)  # fmt: skip
    key = own_rows(batch.key_cache, batch.block_tables, [20, 7], [20, 3])
    value = own_rows(batch.value_cache, batch.block_tables, [20, 7], [20, 3])
    out = poisoned_like(batch.query)
    before = out.clone()
    k, v = change(key, value, batch.key_cache)
    with pytest.raises(ValueError, match=match):
        pk.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                           batch.seq_lens, batch.cu_query_lens, out=out, key=k, value=v)  # fmt: skip
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))  # nothing written
