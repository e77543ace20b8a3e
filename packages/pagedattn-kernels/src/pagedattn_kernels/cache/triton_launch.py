"""Launchers of the cache kernels (``triton_kernels.py``): writing new K/V into their slots and
copying blocks for copy-on-write. (Swapping blocks needs no kernel: see ``torch_impl``.)

Inputs arrive checked (``ops`` checks them). CUDA tensors get the compiled kernels, CPU tensors
the same kernels in Triton's interpreter (``pagedattn_kernels.common.kernels_for``).
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import (
    FP8_DTYPE,
    e4m3_encoder,
    kernels_for,
    next_power_of_2,
    scale_or_unit,
    use_pdl,
)

KERNELS = "pagedattn_kernels.cache.triton_kernels"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    kernel = kernels_for(key.device, KERNELS).reshape_and_cache_kernel
    pdl = use_pdl(key.device)
    kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        scale_or_unit(k_scale, key_cache), scale_or_unit(v_scale, value_cache),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HEADS=next_power_of_2(num_kv_heads), HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1], KV_FP8=key_cache.dtype == FP8_DTYPE,
        E4M3=e4m3_encoder(kernel, key.device), PDL=pdl, launch_pdl=pdl, num_warps=4,
    )  # fmt: skip


def copy_blocks(cache3: torch.Tensor, mapping: torch.Tensor) -> None:
    """``cache3``: a ``[layers, num_blocks, block_elems]`` view with contiguous blocks;
    ``mapping``: contiguous ``[n, 2]`` (src, dst) on the cache's device."""
    num_pairs = mapping.shape[0]
    layers, _, block_elems = cache3.shape
    if num_pairs == 0 or layers == 0 or block_elems == 0:
        return
    chunk = min(4096, next_power_of_2(block_elems))
    grid = (num_pairs, layers, -(-block_elems // chunk))
    pdl = use_pdl(cache3.device)
    kernels_for(cache3.device, KERNELS).copy_blocks_kernel[grid](
        cache3, mapping, cache3.stride(0), cache3.stride(1),
        BLOCK_ELEMS=block_elems, CHUNK=chunk, PDL=pdl, launch_pdl=pdl, num_warps=4,
    )  # fmt: skip
