"""reshape_and_cache against the loop reference: every slot written exactly, -1 skipped,
untouched slots unchanged, strided inputs (K/V sliced out of a fused QKV projection)."""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (head_dim, dtype, block_size, num_kv_heads): each value of each axis at least once.
CASES = [
    (64, F32, 16, 1),
    (80, BF16, 8, 3),
    (96, F16, 32, 2),
    (128, BF16, 16, 8),
    (256, F32, 8, 4),
    (128, F16, 32, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-{c[1]}-bs{c[2]}-h{c[3]}")
def test_reshape_and_cache(target, seed, case):
    head_dim, dtype, block_size, num_kv_heads = case
    gen = target.generator(seed)
    dev = target.device
    num_blocks = 64 if target.full else 6
    num_tokens = 40 * block_size if target.full else 2 * block_size + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, device=dev).to(dtype)
    value_cache = torch.randn(shape, generator=gen, device=dev).to(dtype)
    # K and V as strided views of one fused [tokens, (q + k + v) heads, dim] tensor.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen, device=dev).to(dtype)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=dev)[:num_tokens]
    skip = torch.rand(num_tokens, generator=gen, device=dev) < 0.2
    slots[skip] = -1
    slot_mapping = slots.to(torch.int64 if target.full else torch.int32)

    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slot_mapping)
    pk.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, backend=target.backend)
    assert torch.equal(key_cache, want_k), f"seed={seed}"
    assert torch.equal(value_cache, want_v), f"seed={seed}"


def test_reshape_and_cache_empty_and_all_skipped(target, seed):
    gen = target.generator(seed)
    dev = target.device
    kc = torch.randn(3, 16, 2, 64, generator=gen, device=dev)
    vc = torch.randn(3, 16, 2, 64, generator=gen, device=dev)
    before_k, before_v = kc.clone(), vc.clone()
    empty = torch.empty(0, 2, 64, device=dev)
    pk.reshape_and_cache(empty, empty, kc, vc, torch.empty(0, dtype=torch.int64, device=dev),
                         backend=target.backend)  # fmt: skip
    key = torch.randn(4, 2, 64, generator=gen, device=dev)
    pk.reshape_and_cache(key, key, kc, vc, torch.full((4,), -1, device=dev),
                         backend=target.backend)  # fmt: skip
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)
