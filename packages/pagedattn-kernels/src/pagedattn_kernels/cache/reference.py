"""Float64-exact references of the cache ops, written for obviousness rather than speed: one
token or one (src, dst) pair at a time. They write into the tensors they are given (pass clones)
and run on any device. (Copies are exact in every dtype, so "float64" here means: no rounding.)
"""

from __future__ import annotations

import torch

__all__ = ["copy_blocks", "reshape_and_cache", "swap_blocks"]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    block_size = key_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot == -1:
            continue
        key_cache[slot // block_size, slot % block_size] = key[i]
        value_cache[slot // block_size, slot % block_size] = value[i]


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    for src, dst in block_mapping.tolist():
        kv_cache[..., dst, :, :, :] = kv_cache[..., src, :, :, :].clone()


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    for src, dst in block_mapping.tolist():
        dst_cache[..., dst, :, :, :] = src_cache[..., src, :, :, :].to(dst_cache.device)
