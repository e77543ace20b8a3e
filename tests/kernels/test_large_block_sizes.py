"""Block sizes 64 and 128 (the PagedAttention paper's block-size sweep goes from 1 to 256; the
engine runs 8 to 128): decode (single pass and flash-decoding split), mixed prefill/decode
batches and reshape_and_cache against the float64 and loop references, on every backend.

The kernels gather keys through ``pos // BLOCK_SIZE`` one tile at a time, so a block larger
than a key tile (64 in the interpreter, up to 128 compiled) is read by several tiles and a
tile may cover several small blocks; these cases pin both directions for the large sizes."""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.testing import TOLERANCE, poisoned_like, random_paged_batch, rel_error

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (head_dim, dtype, block_size, queries per KV head)
CASES = [(128, BF16, 64, 4), (64, F32, 128, 1), (80, F16, 128, 3), (128, F32, 64, 8)]


def _id(case: tuple[int, torch.dtype, int, int]) -> str:
    head_dim, dtype, block_size, group = case
    return f"d{head_dim}-{str(dtype).removeprefix('torch.')}-bs{block_size}-g{group}"


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, seed: int, what: str):
    err = rel_error(out, ref)
    assert err < TOLERANCE[dtype], f"{what}: rel error {err:.2e} (seed={seed})"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_decode_large_blocks(target, seed, case):
    head_dim, dtype, block_size, group = case
    gen = target.generator(seed)
    num_kv_heads = 4 if target.full else 1
    # one token, exact multiples, ragged, and (split path) contexts of several blocks
    lens = [1, block_size, 3 * block_size, 2 * block_size + 5, 37, 600, 0]
    if target.full:
        lens += [9000, 20000]
    batch = random_paged_batch(
        gen, lens, [1] * len(lens), num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=target.device,
    )  # fmt: skip
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(*args)
    runs = [(None, None), (None, max(lens))]
    if target.backend == "triton":
        runs += [(1, None), (5, max(lens))]  # one program per sequence; forced splits
    for splits, hint in runs:
        out = pk.paged_decode_attention(
            *args, max_seq_len=hint, num_splits=splits, out=poisoned_like(batch.query),
            backend=target.backend,
        )  # fmt: skip
        _check(out, ref, dtype, seed, f"decode num_splits={splits} max_seq_len={hint}")
        empty = lens.index(0)  # not the last row: the full (GPU) run appends long contexts
        assert bool((out[empty] == 0).all()), "a zero-length sequence must give zeros"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_mixed_batch_large_blocks(target, seed, case):
    head_dim, dtype, block_size, group = case
    gen = target.generator(seed)
    num_kv_heads = 2 if target.full else 1
    pairs = [
        (23, 23),  # fresh prefill inside one block
        (block_size, block_size),  # exactly one block
        (block_size + 3, 5),  # chunk starting mid-block
        (2 * block_size, 1),  # decode at a block boundary
        (3 * block_size + 7, block_size + 2),  # chunk spanning a block boundary
        (40, 0),  # empty chunk
    ]
    lens, q_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    batch = random_paged_batch(
        gen, lens, q_lens, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=target.device,
    )  # fmt: skip
    args = (
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.cu_query_lens,
    )  # fmt: skip
    ref = reference.paged_attention(*args)
    for hints in ({}, {"max_query_len": max(q_lens), "max_seq_len": max(lens)}):
        out = pk.paged_attention(*args, out=poisoned_like(batch.query), backend=target.backend,
                                 **hints)  # fmt: skip
        _check(out, ref, dtype, seed, f"paged_attention {hints}")


@pytest.mark.parametrize("block_size", [64, 128])
def test_reshape_and_cache_large_blocks(target, seed, block_size):
    gen = target.generator(seed)
    dev = target.device
    num_blocks, num_kv_heads, head_dim = 5, 2, 64
    num_tokens = 2 * block_size + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, device=dev).to(BF16)
    value_cache = torch.randn(shape, generator=gen, device=dev).to(BF16)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=dev).to(BF16)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=dev).to(BF16)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=dev)[:num_tokens]
    slots[::7] = -1
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    pk.reshape_and_cache(key, value, key_cache, value_cache, slots, backend=target.backend)
    assert torch.equal(key_cache, want_k), f"seed={seed}"
    assert torch.equal(value_cache, want_v), f"seed={seed}"
