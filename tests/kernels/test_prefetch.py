"""``prefetch_l2``: a hint that changes no value, only where a tensor's bytes are.

- on every target, tensors of several dtypes and sizes (empty, below one chunk, a chunk and a
  bit, unaligned views) are left exactly as they were, and so is everything else;
- the chunks the kernel issues (recorded by the interpreter, and on the GPU) tile the 16-byte
  aligned range exactly: contiguous, no overlap, each a multiple of 16 bytes and at most
  ``CHUNK_BYTES``;
- on the GPU: issued with and without ``evict_last``, inside a captured CUDA graph with and
  without PDL, between kernels that read what the one before wrote (the prefetch kernel lets
  the next launch early; that one must still see the writes);
- bad calls (a strided tensor, not a tensor): a clear ``ValueError`` and nothing written.
"""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.prefetch import triton_launch
from pagedattn_kernels.testing import rejected_unchanged

CHUNK = triton_launch.CHUNK_BYTES


def _sizes(full: bool) -> list[int]:
    """Element counts (bf16): empty, one, below a chunk, a chunk, a chunk and 8 elements, many
    programs' worth (on the GPU: a Llama-3-8B output projection, 4,096 x 4,096)."""
    base = [0, 1, 100, CHUNK // 2, CHUNK // 2 + 8, 40 * CHUNK + 24]
    return [*base, 4096 * 4096] if full else base


def test_changes_nothing_on_every_target(target, seed):
    gen = target.generator(seed)
    for dtype in (torch.bfloat16, torch.float32, torch.uint8):
        for n in _sizes(target.full):
            t = torch.randint(0, 100, (n,), generator=gen, device=target.device).to(dtype)
            other = torch.randn(64, generator=gen, device=target.device)
            want, want_other = t.clone(), other.clone()
            for evict_last in (True, False):
                assert pk.prefetch_l2(t, evict_last=evict_last, backend=target.backend) is None
                assert reference.prefetch_l2(t) is None
            if target.device == "cuda":
                torch.cuda.synchronize()
            assert torch.equal(t, want), f"seed={seed} {dtype} {n}"
            assert torch.equal(other, want_other), f"seed={seed}"


@pytest.mark.parametrize("offset", [0, 1, 3, 15, 16, 17])
@pytest.mark.parametrize("nbytes", [16, 31, 4096, CHUNK, CHUNK + 16, 33 * CHUNK + 48, 70 * CHUNK])
def test_chunks_tile_the_aligned_range(nbytes, offset):
    """In the interpreter, the kernel records the chunks it would issue."""
    storage = torch.zeros(nbytes + 64, dtype=torch.uint8)
    t = storage[offset:offset + nbytes]
    head, length = triton_launch.aligned_range(t.data_ptr(), nbytes)
    assert (t.data_ptr() + head) % 16 == 0 and length % 16 == 0
    assert head + length <= nbytes and nbytes - length - head < 16 and head < 16
    if length == 0:
        return
    chunks = -(-length // CHUNK)
    record = torch.full((chunks, 2), -1, dtype=torch.int64)
    triton_launch.prefetch_l2(t, evict_last=True, record=record)
    starts, sizes = record[:, 0].tolist(), record[:, 1].tolist()
    assert starts[0] == 0
    assert all(a + s == b for a, s, b in zip(starts, sizes, starts[1:], strict=False))
    assert starts[-1] + sizes[-1] == length
    assert all(0 < s <= CHUNK and s % 16 == 0 for s in sizes)
    assert torch.equal(storage, torch.zeros_like(storage))


def test_bad_calls_are_rejected_unchanged():
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    message = rejected_unchanged(lambda: pk.prefetch_l2(t.t()), t)
    assert "contiguous" in message and "prefetch_l2" in message
    with pytest.raises(ValueError, match=r"torch\.Tensor"):
        pk.prefetch_l2([1, 2, 3])
    with pytest.raises(ValueError, match="record"):
        triton_launch.prefetch_l2(t, evict_last=True, record=torch.empty(3, 2, dtype=torch.int64))


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_records_the_same_chunks():
    t = torch.empty(40 * CHUNK + 48, dtype=torch.uint8, device="cuda")[5:]
    _, length = triton_launch.aligned_range(t.data_ptr(), t.numel())
    chunks = -(-length // CHUNK)
    got = torch.full((chunks, 2), -1, dtype=torch.int64, device="cuda")
    triton_launch.prefetch_l2(t, evict_last=False, record=got)
    want = torch.empty((chunks, 2), dtype=torch.int64)
    starts = torch.arange(chunks, dtype=torch.int64) * CHUNK
    want[:, 0] = starts
    want[:, 1] = torch.clamp(length - starts, max=CHUNK)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("evict_last", [True, False])
def test_in_a_cuda_graph_between_dependent_kernels(seed, pdl, evict_last, monkeypatch):
    """silu_and_mul writes ``mid``, the prefetch runs, rms_norm reads ``mid``: replayed on new
    inputs, the graph gives the eager answer (the norm waited for the writes although the
    prefetch kernel let it launch early), and the prefetched weight is unchanged."""
    monkeypatch.setenv("PAGEDATTN_PDL", pdl)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows, hidden = 16, 4096
    weight = torch.randn(hidden, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    want_weight = weight.clone()
    gate_up = torch.empty(rows, 2 * hidden, dtype=torch.bfloat16, device="cuda")
    mid = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    norm_w = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")

    def step():
        pk.silu_and_mul(gate_up, out=mid)
        pk.prefetch_l2(weight, evict_last=evict_last)
        return pk.rms_norm(mid, norm_w, 1e-6)

    gate_up.copy_(torch.randn(rows, 2 * hidden, generator=gen, device="cuda"))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for _ in range(3):
        gate_up.copy_(torch.randn(rows, 2 * hidden, generator=gen, device="cuda"))
        graph.replay()
        want = pk.rms_norm(pk.silu_and_mul(gate_up), norm_w, 1e-6)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"seed={seed}"
    assert torch.equal(weight, want_weight)
