"""Float64 references of the attention ops, written for obviousness rather than speed.

They loop over sequences, tokens and block-table entries one at a time, so each can be read
against the definitions in docs/dev/kernels-api.md. They return float64 and run on any device.
"""

from __future__ import annotations

import torch

__all__ = ["gather_context", "paged_attention", "paged_decode_attention"]


def gather_context(
    cache: torch.Tensor, block_table: list[int], seq_len: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``[seq_len, num_kv_heads, head_dim]`` keys (or values) of one sequence, in float64,
    read position by position through its block table; times ``scale`` (fp8 caches)."""
    block_size = cache.shape[1]
    rows = [cache[block_table[pos // block_size], pos % block_size] for pos in range(seq_len)]
    if not rows:
        return torch.zeros((0, cache.shape[2], cache.shape[3]), dtype=torch.float64)
    values = torch.stack([r.to(torch.float64) for r in rows])
    return values if scale is None else values * float(scale)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 ``[num_tokens, num_heads, head_dim]``: query row j of sequence i (context
    position p = seq_len - q_len + j) attends keys 0..p; query head h reads KV head
    h // (num_heads // num_kv_heads). One token at a time, all heads at once. fp8 caches:
    a cached key is ``fp8 * k_scale`` exactly (float64), a value ``fp8 * v_scale``."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    cu = cu_query_lens.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        table = block_tables[i].tolist()
        k = gather_context(key_cache, table, seq_len, k_scale)
        v = gather_context(value_cache, table, seq_len, v_scale)
        q_len = cu[i + 1] - cu[i]
        for j in range(q_len):
            p = seq_len - q_len + j
            # [kv heads, group, dim]: query head h = kv_head * group + g reads KV head kv_head.
            q = query[cu[i] + j].to(torch.float64).reshape(num_kv_heads, group, head_dim)
            keys = k[: p + 1].transpose(0, 1)  # [kv heads, p + 1, dim]
            values = v[: p + 1].transpose(0, 1)
            scores = (q @ keys.transpose(1, 2)) * scale  # [kv heads, group, p + 1]
            weights = torch.softmax(scores, dim=-1)
            out[cu[i] + j] = (weights @ values).reshape(num_heads, head_dim)
    return out


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The q_len = 1 case, sequence by sequence; a sequence of length 0 gives zeros."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        out[i] = paged_attention(
            query[i : i + 1], key_cache, value_cache, block_tables[i : i + 1],
            seq_lens[i : i + 1], one, scale=scale, k_scale=k_scale, v_scale=v_scale,
        )[0]  # fmt: skip
    return out
