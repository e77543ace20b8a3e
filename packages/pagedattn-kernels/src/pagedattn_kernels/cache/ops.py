"""The cache ops: writing new K/V into their slots (``reshape_and_cache``), copying blocks for
copy-on-write (``copy_blocks``) and swapping blocks between GPU and CPU memory (``swap_blocks``,
on the dedicated ``swap_stream``).

Each op checks its inputs (``checks``), then runs the implementation that fits the tensors'
device (``pagedattn_kernels.common.resolve_backend``): the Triton kernels (``triton_launch``,
``triton_kernels``) or the torch path (``torch_impl``). A swap is the copy engine's work on
every device, so ``swap_blocks`` has only the torch path. ``reference`` holds the float64
definitions they are tested against. Public through ``pagedattn_kernels.ops``.
"""

from __future__ import annotations

import torch

from pagedattn_kernels.cache import torch_impl, triton_launch
from pagedattn_kernels.cache.checks import (
    block_rows,
    check_copy_blocks,
    check_reshape_and_cache,
    check_swap_blocks,
)
from pagedattn_kernels.cache.torch_impl import swap_stream
from pagedattn_kernels.common import (
    FP8_DTYPE,
    as_bytes,
    check_fp8_triton,
    check_kv_scales,
    check_unit_stride,
    resolve_backend,
)

__all__ = ["copy_blocks", "reshape_and_cache", "swap_blocks", "swap_stream"]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Write token i's K/V (``[num_tokens, num_kv_heads, head_dim]``) into slot
    ``slot_mapping[i]`` (= block id * block_size + offset) of the caches; -1 skips the token.
    fp8 caches store e4m3 of ``clamp(key / k_scale, -448, 448)`` (and likewise V), rounded to
    nearest even; ``k_scale`` / ``v_scale``: float32 tensors of one element (None = 1.0)."""
    op = "reshape_and_cache"
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    check_kv_scales(op, key_cache, k_scale, v_scale)
    if resolve_backend(key_cache.device, backend) == "torch":
        torch_impl.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
        )
        return
    check_unit_stride(op, key_cache=key_cache, value_cache=value_cache)
    if key_cache.dtype == FP8_DTYPE:
        check_fp8_triton(op, key_cache.device)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    triton_launch.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
    )


def copy_blocks(
    kv_cache: torch.Tensor, block_mapping: torch.Tensor, *, backend: str | None = None
) -> None:
    """Copy block src to block dst for every (src, dst) row of ``block_mapping [n, 2]``, in every
    leading index of ``kv_cache [..., num_blocks, block_size, num_kv_heads, head_dim]`` (e.g. all
    layers' K and V at once): one kernel launch for everything. Destinations must be distinct
    and must not be sources (true of copy-on-write); otherwise the result is undefined.
    """
    check_copy_blocks(kv_cache, block_mapping)
    kv_cache = as_bytes(kv_cache)  # a copy moves bytes; fp8 is not indexable everywhere
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.int64)
    if resolve_backend(kv_cache.device, backend) == "torch":
        torch_impl.copy_blocks(kv_cache, mapping[:, 0], mapping[:, 1])
        return
    rows = block_rows(kv_cache)
    if rows is None:  # exotic strides: still correct, through torch indexing
        torch_impl.copy_blocks(kv_cache, mapping[:, 0], mapping[:, 1])
        return
    triton_launch.copy_blocks(rows, mapping.contiguous())


def swap_blocks(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    *,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Copy block src of ``src_cache`` to block dst of ``dst_cache`` for every (src, dst) row of
    ``block_mapping [n, 2]``: GPU -> pinned CPU (swap out) or back (swap in), also CPU <-> CPU.
    Caches share the layout ``[..., num_blocks, block_size, num_kv_heads, head_dim]`` (their
    block counts may differ). With a CUDA side it is queued on ``stream`` (default: the
    dedicated ``swap_stream(device)``) after the work already queued on the current stream,
    and returns at once; wait on that stream before using the copied blocks.
    ``block_mapping`` should be a CPU tensor (a CUDA one costs a sync).
    """
    block_mapping = check_swap_blocks(src_cache, dst_cache, block_mapping)
    pairs = [(int(s), int(d)) for s, d in block_mapping.tolist()]
    torch_impl.swap_blocks(as_bytes(src_cache), as_bytes(dst_cache), pairs, stream)
