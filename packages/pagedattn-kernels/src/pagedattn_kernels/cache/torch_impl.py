"""The torch path of the cache ops: writing K/V into slots and copying blocks (the fast path on
CPU, and the fallback for caches whose blocks the Triton copy cannot address), and swapping
blocks between a GPU cache and a pinned CPU cache (swap out / swap in) on every device: a swap
is the copy engine's work, so it has no Triton kernel.

Inputs arrive checked (``ops`` checks them).

How a swap is done on CUDA, and why: each swapped block is one contiguous run of
``block_size * num_kv_heads * head_dim`` elements per leading index (layer, K/V) on both sides.
Pairs whose source and destination ids are both consecutive are merged into runs, and each run
of each leading index becomes one ``copy_(..., non_blocking=True)`` between contiguous slices:
a single ``cudaMemcpyAsync`` straight between the caches, on the swap stream, with no staging
buffer and no host work after the call returns. (A gather into a staging buffer with
``index_select`` would make the GPU side one transfer, but the CPU side would then need a
scatter by the host after the transfer finished, i.e. a sync; the copy engine writing each
block to its final place keeps the whole swap asynchronous.) Copies to or from pageable
(unpinned) CPU memory still work but are synchronous, as CUDA makes them.

The swap stream first waits for the current stream, so a swap out reads the values that the
work queued before it wrote. The caller waits on the swap stream (``stream.synchronize()``, or
``torch.cuda.current_stream().wait_stream(stream)``) before reading swapped-in blocks or
reusing swapped-out GPU blocks. Without a ``stream`` argument a dedicated stream per device is
used; ``swap_stream(device)`` returns it.
"""

from __future__ import annotations

import functools

import torch

from pagedattn_kernels.cache.checks import block_rows
from pagedattn_kernels.common import FP8_DTYPE, FP8_MAX


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    # Index assignment writes into the caches whatever their strides.
    if key_cache.dtype == FP8_DTYPE:
        key_cache.view(torch.uint8)[blocks, offsets] = quantize_fp8(key, k_scale).view(torch.uint8)
        value_cache.view(torch.uint8)[blocks, offsets] = quantize_fp8(value, v_scale).view(
            torch.uint8
        )
        return
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """e4m3 of ``clamp(x / scale, -448, 448)`` in float32 (round to nearest even)."""
    y = x.to(torch.float32)
    if scale is not None:
        y = y / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # not in place: y may be x itself


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block ``src[i]`` to ``dst[i]`` along the block dim (-4) of every leading index."""
    if src.numel() == 0:
        return
    kv_cache.index_copy_(-4, dst, kv_cache.index_select(-4, src))


def swap_blocks_same_device(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    if src.numel() == 0:
        return
    dst_cache.index_copy_(-4, dst, src_cache.index_select(-4, src))


@functools.cache
def _dedicated_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


def swap_stream(device: torch.device | int | str | None = None) -> torch.cuda.Stream:
    """The dedicated stream ``swap_blocks`` uses on ``device`` when given no stream."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    dev = torch.device(dev) if not isinstance(dev, torch.device) else dev
    if isinstance(device, int):
        dev = torch.device("cuda", device)
    if dev.type != "cuda":
        raise ValueError(f"swap streams exist on CUDA devices only, not {dev}")
    return _dedicated_stream(dev.index if dev.index is not None else torch.cuda.current_device())


def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Merge (src, dst) pairs into (src_start, dst_start, count) runs of consecutive ids,
    keeping the given order."""
    merged: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if merged:
            s0, d0, n = merged[-1]
            if src == s0 + n and dst == d0 + n:
                merged[-1] = (s0, d0, n + 1)
                continue
        merged.append((src, dst, 1))
    return merged


def swap_blocks(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    pairs: list[tuple[int, int]],
    stream: torch.cuda.Stream | None,
) -> None:
    """``pairs`` checked by the caller (ids in range, caches of matching block shape)."""
    if not pairs:
        return
    if src_cache.device.type != "cuda" and dst_cache.device.type != "cuda":
        src = torch.tensor([p[0] for p in pairs], device=src_cache.device)
        dst = torch.tensor([p[1] for p in pairs], device=dst_cache.device)
        swap_blocks_same_device(src_cache, dst_cache, src, dst)
        return
    gpu = src_cache.device if src_cache.device.type == "cuda" else dst_cache.device
    if stream is None:
        stream = swap_stream(gpu)
    src3 = block_rows(src_cache)
    dst3 = block_rows(dst_cache)
    if src3 is None or dst3 is None:  # checked by ops.swap_blocks; kept for direct callers
        raise ValueError("swap_blocks needs caches whose blocks are contiguous")
    stream.wait_stream(torch.cuda.current_stream(gpu))
    with torch.cuda.stream(stream):
        for s0, d0, n in runs(pairs):
            for layer in range(src3.shape[0]):
                dst3[layer, d0 : d0 + n].copy_(src3[layer, s0 : s0 + n], non_blocking=True)
