"""Value caches stored key-major (``pagedattn_kernels.key_major_values``): every op reads and
writes the same values as with the usual layout; only the strides differ.

- the layout: blocks of ``[num_kv_heads, head_dim, block_size]``, unit stride on the token dim,
  each block one contiguous run (copy-on-write and swaps move whole blocks);
- ``reshape_and_cache`` writes the same values (bit for bit, fp8 codes included);
- decode (with and without the flash-decoding split) and mixed prefill attention give the
  same outputs: bit for bit in the interpreter, where the arithmetic is the same; on a GPU
  within the dtype's tolerance of the float64 reference;
- a value cache with neither unit stride is refused, nothing written.
"""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.testing import TOLERANCE, poisoned_like, random_paged_batch, rel_error

BF16, F16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


def _key_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values as ``cache`` in a key-major value cache."""
    nb, bs, h, d = cache.shape
    out = pk.key_major_values(nb, bs, h, d, dtype=cache.dtype, device=cache.device)
    out.copy_(cache)
    return out


def _scale(value: float, device: str) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=device)


def _batch(target, seed, dtype, cache_dtype, block_size, pairs, head_dim=128, group=4):
    gen = target.generator(seed)
    kv_heads = 2 if target.full else 1
    lens, q_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    batch = random_paged_batch(
        gen, lens, q_lens, num_heads=kv_heads * group, num_kv_heads=kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=target.device,
    )  # fmt: skip
    scales = {}
    if cache_dtype == FP8:
        batch.key_cache = (4 * batch.key_cache.float()).to(FP8)
        batch.value_cache = (4 * batch.value_cache.float()).to(FP8)
        scales = {"k_scale": _scale(0.25, target.device), "v_scale": _scale(0.5, target.device)}
    return batch, scales


def test_layout():
    v = pk.key_major_values(5, 16, 2, 64, dtype=FP8, device="cpu")
    assert v.shape == (5, 16, 2, 64) and v.dtype == FP8
    assert v.stride() == (16 * 2 * 64, 1, 64 * 16, 16)
    assert v[1].permute(1, 2, 0).is_contiguous()  # one block: [heads, dim, block_size]
    assert v.float().abs().sum() == 0


def _check(target, out, same, ref, dtype, what):
    if not target.full:  # the interpreter: the same arithmetic in the same order
        assert torch.equal(out, same), what
    err = rel_error(out, ref)
    assert err < TOLERANCE[dtype], f"{what}: rel error {err:.2e}"


@pytest.mark.parametrize("cache_dtype", [FP8, BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_reads_key_major_values(target, seed, cache_dtype, block_size):
    pairs = [(1, 1), (block_size, 1), (2 * block_size + 5, 1), (37, 1), (0, 1)]
    if target.full:
        pairs += [(1000, 1), (4099, 1)]
    batch, scales = _batch(target, seed, BF16, cache_dtype, block_size, pairs)
    vkm = _key_major(batch.value_cache)
    args = (batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(batch.query, *args, **scales)
    splits = (None, 3) if target.backend == "triton" else (None,)
    for num_splits in splits:
        kw = dict(backend=target.backend, num_splits=num_splits, **scales)
        same = pk.paged_decode_attention(batch.query, *args, out=poisoned_like(batch.query), **kw)
        out = pk.paged_decode_attention(batch.query, batch.key_cache, vkm, batch.block_tables,
                                        batch.seq_lens, out=poisoned_like(batch.query), **kw)
        _check(target, out, same, ref, BF16, f"splits={num_splits} (seed={seed})")


@pytest.mark.parametrize("cache_dtype", [FP8, F16], ids=["fp8", "f16"])
def test_mixed_batch_reads_key_major_values(target, seed, cache_dtype):
    """Fresh prefills, a chunk continuing a cached prefix, decodes and an empty chunk."""
    bs = 16
    pairs = [(23, 23), (40, 9), (1, 1), (2 * bs, 1), (30, 0), (bs + 3, 5)]
    if target.full:
        pairs += [(1500, 1500), (4100, 700)]
    batch, scales = _batch(target, seed, F16, cache_dtype, bs, pairs)
    vkm = _key_major(batch.value_cache)
    tail = (batch.block_tables, batch.seq_lens, batch.cu_query_lens)
    ref = reference.paged_attention(batch.query, batch.key_cache, batch.value_cache, *tail,
                                    **scales)  # fmt: skip
    kw = dict(backend=target.backend, **scales)
    same = pk.paged_attention(batch.query, batch.key_cache, batch.value_cache, *tail,
                              out=poisoned_like(batch.query), **kw)  # fmt: skip
    out = pk.paged_attention(batch.query, batch.key_cache, vkm, *tail,
                             out=poisoned_like(batch.query), **kw)  # fmt: skip
    _check(target, out, same, ref, F16, f"seed={seed}")


@pytest.mark.parametrize("cache_dtype", [FP8, BF16], ids=["fp8", "bf16"])
def test_reshape_and_cache_into_key_major_values(target, seed, cache_dtype):
    gen = target.generator(seed)
    dev = target.device
    nb, bs, h, d, tokens = 6, 16, 2, 64, 40
    key = (3 * torch.randn(tokens, h, d, generator=gen, device=dev)).to(BF16)
    value = (3 * torch.randn(tokens, h, d, generator=gen, device=dev)).to(BF16)
    slots = torch.randperm(nb * bs, generator=gen, device=dev)[:tokens]
    slots[3] = -1  # skipped
    scales = {"k_scale": _scale(0.05, dev), "v_scale": _scale(0.03, dev)} if cache_dtype == FP8 else {}
    kc = torch.zeros(nb, bs, h, d, dtype=cache_dtype, device=dev)
    vc = torch.zeros_like(kc)
    pk.reshape_and_cache(key, value, kc, vc, slots, backend=target.backend, **scales)
    kc2 = torch.zeros_like(kc)
    vkm = pk.key_major_values(nb, bs, h, d, dtype=cache_dtype, device=dev)
    pk.reshape_and_cache(key, value, kc2, vkm, slots, backend=target.backend, **scales)
    assert torch.equal(kc2.view(torch.uint8) if cache_dtype == FP8 else kc2,
                       kc.view(torch.uint8) if cache_dtype == FP8 else kc)  # fmt: skip
    assert torch.equal(vkm.contiguous().view(torch.uint8) if cache_dtype == FP8 else vkm,
                       vc.view(torch.uint8) if cache_dtype == FP8 else vc)  # fmt: skip


@pytest.mark.parametrize("backend", ["triton"])
def test_value_cache_without_unit_stride_is_refused(seed, backend):
    gen = torch.Generator().manual_seed(seed)
    nb, bs, h, d = 4, 16, 2, 32
    kc = torch.randn(nb, bs, h, d, generator=gen)
    # heads innermost: neither the head dim nor the token dim has stride 1
    vc = torch.randn(nb, d, bs, h, generator=gen).permute(0, 2, 3, 1)
    before = vc.clone()
    key = torch.randn(3, h, d, generator=gen)
    with pytest.raises(ValueError, match="value_cache needs stride 1"):
        pk.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1, 2]), backend=backend)
    assert torch.equal(vc, before)
    q = torch.randn(2, 2 * h, d, generator=gen)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="value_cache needs stride 1"):
        pk.paged_decode_attention(q, kc, vc, tables, lens, backend=backend)
