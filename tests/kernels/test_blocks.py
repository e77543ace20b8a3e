"""copy_blocks and swap_blocks against the loop references."""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.cache.torch_impl import runs


def _cow_mapping(gen: torch.Generator, num_blocks: int, n: int) -> torch.Tensor:
    """n (src, dst) pairs with distinct destinations that are never sources."""
    ids = torch.randperm(num_blocks, generator=gen, device=gen.device).cpu()
    dst = ids[:n]
    src = ids[n:][torch.randint(0, num_blocks - n, (n,), generator=gen, device=gen.device).cpu()]
    return torch.stack([src, dst], dim=1).to(torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_blocks_all_layers(target, seed, dtype):
    """One call for all layers' K and V: kv_cache[layers, 2, blocks, block_size, heads, dim]."""
    gen = target.generator(seed)
    layers, num_blocks = (4, 200) if target.full else (2, 12)
    kv = torch.randn(layers, 2, num_blocks, 16, 2, 80, generator=gen, device=target.device)
    kv = kv.to(dtype)
    mapping = _cow_mapping(gen, num_blocks, num_blocks // 3)
    want = kv.clone()
    reference.copy_blocks(want, mapping)
    pk.copy_blocks(kv, mapping.to(target.device), backend=target.backend)
    assert torch.equal(kv, want), f"seed={seed}"
    # A single layer's K cache (4-D), the mapping left on the CPU.
    one = kv[0, 1]
    want1 = one.clone()
    reference.copy_blocks(want1, mapping[:2])
    pk.copy_blocks(one, mapping[:2], backend=target.backend)
    assert torch.equal(one, want1), f"seed={seed}"


def test_copy_blocks_strided_cache_falls_back(target, seed):
    """A cache whose blocks are not contiguous still copies right (through torch indexing)."""
    gen = target.generator(seed)
    big = torch.randn(6, 8, 4, 32, generator=gen, device=target.device)
    cache = big[:, :, 1:3]  # blocks not contiguous
    mapping = torch.tensor([[0, 5], [2, 3]])
    want = cache.clone()
    reference.copy_blocks(want, mapping)
    pk.copy_blocks(cache, mapping, backend=target.backend)
    assert torch.equal(cache, want)


def test_runs_merges_consecutive_pairs():
    assert runs([(3, 7), (4, 8), (5, 9), (9, 1), (10, 3), (11, 4)]) == [
        (3, 7, 3),
        (9, 1, 1),
        (10, 3, 2),
    ]
    assert runs([]) == []


def test_swap_blocks_cpu(seed):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(3, 2, 10, 16, 2, 64, generator=gen)
    dst = torch.randn(3, 2, 7, 16, 2, 64, generator=gen)
    mapping = torch.tensor([[1, 0], [2, 1], [3, 2], [9, 6], [0, 4]])
    want = dst.clone()
    reference.swap_blocks(src, want, mapping)
    pk.swap_blocks(src, dst, mapping)
    assert torch.equal(dst, want)


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [None, 3])
def test_swap_blocks_gpu_roundtrip(seed, layers):
    """Swap out to pinned host memory and back, on the dedicated stream and on a given one;
    the call returns before the copy is waited for, and the data arrive after a sync."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lead = () if layers is None else (layers, 2)
    gpu = torch.randn(*lead, 300, 16, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    host = torch.zeros(*lead, 200, 16, 8, 128, dtype=torch.bfloat16).pin_memory()
    out_pairs = [(i, 199 - i) for i in range(0, 120, 2)] + [(200 + i, 10 + i) for i in range(40)]
    mapping = torch.tensor(out_pairs)
    want_host = host.clone()
    reference.swap_blocks(gpu, want_host, mapping)
    pk.swap_blocks(gpu, host, mapping)
    pk.swap_stream(gpu.device).synchronize()
    assert torch.equal(host, want_host), f"seed={seed}"
    # Swap back into other GPU blocks on a caller's stream.
    stream = torch.cuda.Stream()
    back = torch.tensor([[d, s + 1] for s, d in out_pairs if s + 1 < 300])
    want_gpu = gpu.clone()
    reference.swap_blocks(host, want_gpu, back)
    pk.swap_blocks(host, gpu, back, stream=stream)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(gpu, want_gpu), f"seed={seed}"
