"""Input checks of the cache ops (both backends), run before anything is written.

Shapes, dtypes and devices are always checked; slot and block ids only when they live on the
CPU (see ``pagedattn_kernels.common``).
"""

from __future__ import annotations

import math

import torch

from pagedattn_kernels.common import (
    check_caches,
    check_float,
    check_index,
    check_same_device,
    fail,
)


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    op: str = "reshape_and_cache",
) -> None:
    nb, bs, hkv, d = check_caches(op, key_cache, value_cache)
    check_float(op, "key", key, 3)
    check_float(op, "value", value, 3)
    if key.shape != value.shape:
        raise fail(op, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    if tuple(key.shape[1:]) != (hkv, d):
        raise fail(
            op,
            f"key has {tuple(key.shape[1:])} (kv heads, head dim) but the caches hold {(hkv, d)}",
        )
    check_index(op, "slot_mapping", slot_mapping, (key.shape[0],))
    check_same_device(op, key_cache.device, key=key, value=value, slot_mapping=slot_mapping)
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= nb * bs:
            raise fail(
                op,
                f"slot_mapping holds {lo}..{hi} but slots run 0..{nb * bs - 1} (-1 = skip)",
            )


def check_block_mapping(op: str, mapping: torch.Tensor, src_blocks: int, dst_blocks: int) -> None:
    check_index(op, "block_mapping", mapping, (None, 2))
    if mapping.device.type == "cpu" and mapping.numel():
        src, dst = mapping[:, 0], mapping[:, 1]
        if int(src.min()) < 0 or int(src.max()) >= src_blocks:
            raise fail(op, f"source block ids must lie in 0..{src_blocks - 1}")
        if int(dst.min()) < 0 or int(dst.max()) >= dst_blocks:
            raise fail(op, f"destination block ids must lie in 0..{dst_blocks - 1}")


def check_block_caches(op: str, **caches: torch.Tensor) -> None:
    for name, t in caches.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise fail(op, f"{name} must be [..., num_blocks, block_size, heads, dim], got {shape}")


def block_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """``cache [..., num_blocks, block_size, heads, dim]`` viewed as ``[L, num_blocks, E]``
    (E = one block's elements), or None when the blocks are not contiguous or the leading
    dims do not collapse into one stride."""
    if cache.dim() < 4:
        return None
    num_blocks = cache.shape[-4]
    elems = math.prod(cache.shape[-3:])
    inner = cache[(0,) * (cache.dim() - 3)] if cache.numel() else cache
    if cache.numel() and not inner.is_contiguous():
        return None
    try:
        return cache.view(-1, num_blocks, elems)
    except RuntimeError:
        return None


def check_copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    op = "copy_blocks"
    check_block_caches(op, kv_cache=kv_cache)
    num_blocks = kv_cache.shape[-4]
    check_block_mapping(op, block_mapping, num_blocks, num_blocks)


def check_swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
) -> torch.Tensor:
    """Returns ``block_mapping`` on the CPU (checked there; a CUDA one costs a sync)."""
    op = "swap_blocks"
    check_block_caches(op, src_cache=src_cache, dst_cache=dst_cache)
    if src_cache.shape[:-4] != dst_cache.shape[:-4] or src_cache.shape[-3:] != dst_cache.shape[-3:]:
        raise fail(
            op,
            f"src_cache {tuple(src_cache.shape)} and dst_cache {tuple(dst_cache.shape)} must "
            "match in every dim but the block count",
        )
    if src_cache.dtype != dst_cache.dtype:
        raise fail(op, f"src_cache is {src_cache.dtype} but dst_cache is {dst_cache.dtype}")
    check_block_mapping(op, block_mapping, src_cache.shape[-4], dst_cache.shape[-4])
    cuda = [t.device for t in (src_cache, dst_cache) if t.device.type == "cuda"]
    if len(cuda) == 2 and cuda[0] != cuda[1]:
        raise fail(op, "the two caches are on different GPUs")
    if cuda and (block_rows(src_cache) is None or block_rows(dst_cache) is None):
        raise fail(op, "with a GPU side, both caches need contiguous blocks")
    if block_mapping.device.type != "cpu":
        block_mapping = block_mapping.cpu()  # a sync; documented
        check_block_mapping(op, block_mapping, src_cache.shape[-4], dst_cache.shape[-4])
    return block_mapping
