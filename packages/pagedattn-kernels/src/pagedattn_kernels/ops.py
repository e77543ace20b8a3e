"""The public ops: check the inputs, then run the backend that fits the tensors' device.

See docs/dev/kernels-api.md (the contract the engine is written against) and the README.
Every op also takes ``backend=`` (``"auto"``, ``"torch"``, ``"triton"``; default: the
``PAGEDATTN_BACKEND`` environment variable, else ``"auto"``): ``auto`` runs the Triton kernels
on CUDA tensors and the torch path on CPU tensors; ``triton`` on CPU tensors runs the kernels in
Triton's interpreter (slow; for tests).
"""

from __future__ import annotations

import functools

import torch

from pagedattn_kernels import swap, torch_ops
from pagedattn_kernels.backend import resolve_backend
from pagedattn_kernels.validation import (
    block_rows,
    check_attention,
    check_block_caches,
    check_block_mapping,
    check_reshape_and_cache,
    check_unit_stride,
    fail,
)


@functools.cache
def _triton_ops():  # imported lazily: CPU users need no triton
    from pagedattn_kernels import triton_ops

    return triton_ops


def _check_triton_attention(
    op: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    out: torch.Tensor,
) -> None:  # fmt: skip
    limit = _triton_ops().MAX_HEAD_DIM
    if (
        query.shape[2] <= limit
        and key_cache.stride(-1) == 1
        and value_cache.stride(-1) == 1
        and out.stride(-1) == 1
    ):
        return
    if query.shape[2] > limit:
        raise fail(op, f"the Triton kernels take head dims up to {limit}; use backend='torch'")
    check_unit_stride(op, key_cache=key_cache, value_cache=value_cache, out=out)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write token i's K/V (``[num_tokens, num_kv_heads, head_dim]``) into slot
    ``slot_mapping[i]`` (= block id * block_size + offset) of the caches; -1 skips the token."""
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    if resolve_backend(key_cache.device, backend) == "torch":
        torch_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    op = "reshape_and_cache"
    check_unit_stride(op, key_cache=key_cache, value_cache=value_cache)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _triton_ops().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    *,
    scale: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention for a packed, mixed batch of prefill chunks and decode tokens.

    Sequence i owns query rows ``cu_query_lens[i]:cu_query_lens[i+1]``: the last q_len_i
    tokens of its ``seq_lens[i]``-token context, whose K/V are already in the cache. The token
    at context position p sees keys 0..p. Returns ``out`` (allocated when None).
    With ``max_query_len == 1`` (all decode) the flash-decoding kernel runs instead.
    """
    op = "paged_attention"
    check_attention(
        op, query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, out,
        scale, max_query_len, max_seq_len,
    )  # fmt: skip
    scale = float(scale) if scale is not None else query.shape[2] ** -0.5
    if out is None:
        out = torch.empty_like(query)
    if resolve_backend(key_cache.device, backend) == "torch":
        return torch_ops.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, scale, out
        )
    _check_triton_attention(op, query, key_cache, value_cache, out)
    query = query if query.stride(-1) == 1 else query.contiguous()
    if max_query_len == 1 and query.shape[0] == seq_lens.shape[0]:
        return _triton_ops().paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out
        )
    return _triton_ops().paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, scale, out
    )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query token per sequence (``query [num_seqs, num_heads, head_dim]``) attending its
    whole context of ``seq_lens[i]`` tokens. On the GPU, long contexts are split over several
    programs (flash-decoding) and merged; ``num_splits`` overrides the automatic choice
    (Triton backend only). A sequence of length 0 (batch padding) gets zeros.
    """
    op = "paged_decode_attention"
    check_attention(
        op, query, key_cache, value_cache, block_tables, seq_lens, None, out,
        scale, None, max_seq_len,
    )  # fmt: skip
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise fail(op, f"num_splits must be a positive int, got {num_splits!r}")
    scale = float(scale) if scale is not None else query.shape[2] ** -0.5
    if out is None:
        out = torch.empty_like(query)
    if resolve_backend(key_cache.device, backend) == "torch":
        return torch_ops.paged_decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens, scale, out
        )
    _check_triton_attention(op, query, key_cache, value_cache, out)
    query = query if query.stride(-1) == 1 else query.contiguous()
    return _triton_ops().paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len, out,
        num_splits=num_splits,
    )  # fmt: skip


def copy_blocks(
    kv_cache: torch.Tensor, block_mapping: torch.Tensor, *, backend: str | None = None
) -> None:
    """Copy block src to block dst for every (src, dst) row of ``block_mapping [n, 2]``, in every
    leading index of ``kv_cache [..., num_blocks, block_size, num_kv_heads, head_dim]`` (e.g. all
    layers' K and V at once): one kernel launch for everything. Destinations must be distinct
    and must not be sources (true of copy-on-write); otherwise the result is undefined.
    """
    op = "copy_blocks"
    check_block_caches(op, kv_cache=kv_cache)
    num_blocks = kv_cache.shape[-4]
    check_block_mapping(op, block_mapping, num_blocks, num_blocks)
    mapping = block_mapping.to(device=kv_cache.device, dtype=torch.int64)
    if resolve_backend(kv_cache.device, backend) == "torch":
        torch_ops.copy_blocks(kv_cache, mapping[:, 0], mapping[:, 1])
        return
    rows = block_rows(kv_cache)
    if rows is None:  # exotic strides: still correct, through torch indexing
        torch_ops.copy_blocks(kv_cache, mapping[:, 0], mapping[:, 1])
        return
    _triton_ops().copy_blocks(rows, mapping.contiguous())


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
    pairs = [(int(s), int(d)) for s, d in block_mapping.tolist()]
    swap.swap_blocks(src_cache, dst_cache, pairs, stream)
