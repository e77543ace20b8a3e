"""Paged attention as a model layer: the only place where model code touches the KV cache.

Every model calls :class:`Attention` with this step's queries, keys and values (and, for a
model with rotary positions, the step's angles: the layer rotates the queries and keys itself,
so that on a GPU the rotation and the cache write are one kernel). The layer first writes the
new keys and values into the layer's paged caches (``reshape_and_cache``), then attends through
the block tables. Because the write happens before the read inside the same layer, a
prefill chunk sees its own tokens and a decode token sees itself, with no special cases.

The runner builds one :class:`AttentionMetadata` per step and every layer shares it.

With an fp8 KV cache (``--kv-cache-dtype fp8``) the write quantizes to e4m3 and the kernels read
``fp8 * scale``; each layer holds its K and V scales (``k_scale``, ``v_scale``: float32 tensors
of one element, 1.0 unless a checkpoint or a caller sets them), passed to the kernels as
tensors so that a captured CUDA graph reads their current values. A cache in the model dtype
ignores them and runs exactly as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

import pagedattn_kernels

if TYPE_CHECKING:
    from pagedkv.engine.models.layers import RotaryAngles

#: Set while `worker.piecewise_graphs` captures a forward pass piece by piece: every
#: `Attention` call goes to it instead (see `graph_breaks`).
_graph_break: Callable | None = None


@contextlib.contextmanager
def graph_breaks(fn: Callable) -> Iterator[None]:
    """Within this block each `Attention.forward(query, key, value, kv_cache, meta)` returns
    `fn(layer, query, key, value, kv_cache)` instead of attending: the piecewise CUDA graphs
    end a graph there and run attention eagerly between graphs."""
    global _graph_break
    prev, _graph_break = _graph_break, fn
    try:
        yield
    finally:
        _graph_break = prev


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and what each sequence attends to.

    Tokens of all sequences are packed along one axis (``T`` tokens in total, ``B`` sequences);
    sequence ``i`` owns rows ``cu_query_lens[i]:cu_query_lens[i + 1]``, which are the last
    query tokens of its context of ``seq_lens[i]`` tokens.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1 = padding, skipped)
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical block ids per sequence
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    cu_query_lens: torch.Tensor  # [B + 1] int32: prefix sums of query lengths
    max_query_len: int  # host-side hint, avoids a device sync
    max_seq_len: int  # host-side hint, avoids a device sync
    decode_only: bool  # every sequence has exactly one query token
    # In a mixed batch, the first `num_decode_seqs` sequences have one query token each: they
    # go to the flash-decoding kernel, the rest (cu_query_lens rebased: `prefill_cu_query_lens`)
    # to the prefill kernel, whose query tiles would be mostly empty for single tokens.
    num_decode_seqs: int = 0
    prefill_cu_query_lens: torch.Tensor | None = None
    # Decode rows on a GPU (a decode-only step's, or a mixed pass's leading `num_decode_seqs`):
    # the order their attention programs should start, longest context first
    # (`worker.inputs.longest_first`; the kernel's `seq_order`). None: batch order.
    decode_order: torch.Tensor | None = None
    # ... or, where plans pay, the decode rows' attention plan (`worker.decode_plans`): which
    # program attends which chunk of which row, in place of the kernel's splits and the order.
    decode_plan: pagedattn_kernels.DecodePlan | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class Attention(nn.Module):
    """Writes new K/V into the paged caches, then computes causal attention through them.

    ``forward`` takes ``query [T, num_heads * head_dim]`` (or ``[T, num_heads, head_dim]``) and
    ``key``/``value`` with ``num_kv_heads`` heads likewise, and returns ``[T, num_heads * head_dim]``.
    Grouped-query attention comes from ``num_heads`` being a multiple of ``num_kv_heads``.
    """

    def __init__(
        self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.register_buffer("k_scale", torch.ones(1), persistent=False)
        self.register_buffer("v_scale", torch.ones(1), persistent=False)

    def init_buffers(self) -> None:
        """Refill the fp8 scales with 1.0 in float32 (whatever the model dtype) after the module
        was materialized from the meta device or cast."""
        self.k_scale = torch.ones(1, dtype=torch.float32, device=self.k_scale.device)
        self.v_scale = torch.ones(1, dtype=torch.float32, device=self.v_scale.device)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
        rope: RotaryAngles | None = None,
    ) -> torch.Tensor:
        """`out`: a `[T, num_heads * head_dim]` (or 3-d) buffer to write into. `rope`: this
        step's rotary angles, applied to `query` and `key` before anything else (in the
        kernel that writes the cache, with the fused kernels)."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        if _graph_break is not None:
            if rope is not None:  # inside the graph piece before the break, as its own kernel
                query, key = rope.apply(query, key)
            return _graph_break(self, query, key, value, kv_cache)
        if out is not None:
            out = out.view(num_tokens, self.num_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        scales = {}
        if key_cache.dtype == pagedattn_kernels.FP8_DTYPE:
            scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        # The prefill kernel reads each chunk's own keys from these rows rather than gathering
        # them back from the cache (the same values, unless the cache rounds them to fp8).
        own = not scales
        if rope is not None:
            query, key = rope.apply_and_cache(query, key, value, kv_cache, meta.slot_mapping,
                                              **scales)  # fmt: skip
        else:
            pagedattn_kernels.reshape_and_cache(
                key, value, key_cache, value_cache, meta.slot_mapping, **scales
            )
        if meta.decode_only:
            out = pagedattn_kernels.paged_decode_attention(
                query,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                scale=self.scale,
                max_seq_len=meta.max_seq_len,
                out=out,
                seq_order=meta.decode_order,
                plan=meta.decode_plan,
                **scales,
            )
        elif meta.num_decode_seqs:
            nd = meta.num_decode_seqs
            if out is None:
                out = torch.empty_like(query)
            pagedattn_kernels.paged_decode_attention(
                query[:nd],
                key_cache,
                value_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale=self.scale,
                max_seq_len=meta.max_seq_len,
                out=out[:nd],
                seq_order=meta.decode_order,
                plan=meta.decode_plan,
                **scales,
            )
            pagedattn_kernels.paged_attention(
                query[nd:],
                key_cache,
                value_cache,
                meta.block_tables[nd:],
                meta.seq_lens[nd:],
                meta.prefill_cu_query_lens,
                scale=self.scale,
                max_query_len=meta.max_query_len,
                max_seq_len=meta.max_seq_len,
                out=out[nd:],
                key=key[nd:] if own else None,
                value=value[nd:] if own else None,
                **scales,
            )
        else:
            out = pagedattn_kernels.paged_attention(
                query,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.cu_query_lens,
                scale=self.scale,
                max_query_len=meta.max_query_len,
                max_seq_len=meta.max_seq_len,
                out=out,
                key=key if own else None,
                value=value if own else None,
                **scales,
            )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.6g}"
        )
