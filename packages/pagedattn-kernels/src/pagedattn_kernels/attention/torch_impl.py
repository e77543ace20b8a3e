"""The torch path of the attention ops: the fast path on CPU (and a fallback anywhere).

Attention gathers each sequence's blocks with one indexing op and hands the contiguous K/V to
``torch.nn.functional.scaled_dot_product_attention`` (fused and multi-threaded on CPU), with
``enable_gqa`` for grouped-query attention and a boolean mask for the causal offset of a chunk
that continues an earlier context. Decode tokens (chunks of one query) of similar context
lengths are batched into one SDPA call with a key-padding mask, so a decode step costs a few
calls per layer rather than one per sequence.

fp8 caches are gathered as fp8 (the bytes, half the memory traffic of 16-bit ones) and only the
gathered context is converted: ``fp8 -> float32``, times the scale, rounded to the query's dtype.

Inputs arrive checked (``ops`` checks them). The host reads lengths with ``tolist()``,
which is free on CPU tensors and a device sync on CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedattn_kernels.common import FP8_DTYPE

# A decode group's padded length stays within this factor of its shortest context (plus a
# little), so batching never multiplies the work of short sequences by much.
_GROUP_SPREAD = 1.5
_GROUP_SLACK = 64


@dataclass(frozen=True, slots=True)
class KVRead:
    """How cached K/V become the query's dtype: as they are, or (fp8 caches) ``fp8 * scale``."""

    dtype: torch.dtype
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def dequantize(self, picked: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if picked.dtype != FP8_DTYPE:
            return picked
        values = picked.to(torch.float32)
        if scale is not None:
            values = values * scale
        return values.to(self.dtype)


def _gather(
    cache: torch.Tensor, table_rows: torch.Tensor, length: int, read: KVRead,
    scale: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """K or V of sequences as ``[batch, num_kv_heads, length, head_dim]`` (a copy) in the
    query's dtype."""
    batch, num_blocks = table_rows.shape
    if cache.dtype == FP8_DTYPE:  # torch indexes fp8 tensors as their bytes
        picked = cache.view(torch.uint8)[table_rows].view(FP8_DTYPE)
    else:
        picked = cache[table_rows]  # [batch, blocks, block_size, heads, dim]
    picked = picked.reshape(batch, num_blocks * cache.shape[1], cache.shape[2], cache.shape[3])
    return read.dequantize(picked[:, :length], scale).transpose(1, 2)


def _decode_groups(lens: list[int], members: list[int]) -> list[list[int]]:
    """Split decode sequences (indices into ``lens``) into groups of similar context length."""
    order = sorted(members, key=lambda i: lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lens[i] <= _GROUP_SPREAD * lens[groups[-1][0]] + _GROUP_SLACK:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _decode_batch(
    query_rows: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table_rows: torch.Tensor,
    lens: list[int],
    scale: float,
    read: KVRead,
) -> torch.Tensor:
    """Attention of one query token per sequence; ``query_rows`` ``[batch, heads, dim]``."""
    longest = max(lens)
    block_size = key_cache.shape[1]
    cols = -(-longest // block_size)
    table_rows = table_rows[:, :cols].to(torch.int64)
    if min(lens) != longest:
        # Entries past a sequence's own blocks are arbitrary: point them at block 0.
        need = torch.tensor([-(-n // block_size) for n in lens], device=table_rows.device)
        in_use = torch.arange(cols, device=table_rows.device)[None, :] < need[:, None]
        table_rows = torch.where(in_use, table_rows, 0)
    k = _gather(key_cache, table_rows, longest, read, read.k_scale)
    v = _gather(value_cache, table_rows, longest, read, read.v_scale)
    q = query_rows.unsqueeze(2)  # [batch, heads, 1, dim]
    gqa = q.shape[1] != k.shape[1]
    # One call per sequence, over exactly its own keys: batch-invariant. A call over several
    # sequences (padded and masked, or not) gives a sequence other bits depending on its
    # batch mates when torch runs SDPA on more than one thread, and seeded sampling must not
    # depend on what else is in the batch.
    out = torch.empty_like(q)
    for j, n in enumerate(lens):
        out[j : j + 1] = F.scaled_dot_product_attention(
            q[j : j + 1], k[j : j + 1, :, :n], v[j : j + 1, :, :n], scale=scale, enable_gqa=gqa
        )
    return out.squeeze(2)


def _prefill_one(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table_row: torch.Tensor,
    seq_len: int,
    scale: float,
    read: KVRead,
) -> torch.Tensor:
    """Causal attention of the last ``q.shape[0]`` tokens of a ``seq_len`` context."""
    q_len = q.shape[0]
    block_size = key_cache.shape[1]
    table_row = table_row[None, : -(-seq_len // block_size)].to(torch.int64)
    k = _gather(key_cache, table_row, seq_len, read, read.k_scale)
    v = _gather(value_cache, table_row, seq_len, read, read.v_scale)
    context = seq_len - q_len
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
    gqa = qh.shape[1] != k.shape[1]
    if context == 0:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        rows = torch.arange(context, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows[:, None]
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    read = KVRead(query.dtype, k_scale, v_scale)
    lens = [int(x) for x in seq_lens.tolist()]
    cu = [int(x) for x in cu_query_lens.tolist()]
    decodes: list[int] = []
    for i, seq_len in enumerate(lens):
        q_len = cu[i + 1] - cu[i]
        if q_len == 0:
            continue
        if q_len == 1:
            decodes.append(i)
        else:
            q = query[cu[i] : cu[i + 1]]
            out[cu[i] : cu[i + 1]] = _prefill_one(
                q, key_cache, value_cache, block_tables[i], seq_len, scale, read
            )
    if decodes:
        rows = torch.tensor([cu[i] for i in decodes], device=query.device)
        result = torch.empty_like(query[rows])
        _decode(
            query[rows], key_cache, value_cache, block_tables, lens, decodes, scale, result, read
        )
        out[rows] = result
    return out


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: list[int],
    seqs: list[int],
    scale: float,
    result: torch.Tensor,
    read: KVRead,
) -> torch.Tensor:
    """Decode attention for sequences ``seqs`` (query row j belongs to ``seqs[j]``), written
    into ``result`` (row j likewise)."""
    position = {s: j for j, s in enumerate(seqs)}
    empty = [position[s] for s in seqs if lens[s] == 0]  # length 0 = batch padding: zeros
    if empty:
        result[torch.tensor(empty, device=result.device)] = 0
    live = [s for s in seqs if lens[s] > 0]
    for group in _decode_groups(lens, live):
        rows = [position[s] for s in group]
        identity = rows == list(range(len(seqs)))
        index = torch.tensor(rows, device=query.device)
        out_rows = _decode_batch(
            query if identity else query[index],
            key_cache,
            value_cache,
            block_tables[torch.tensor(group, device=block_tables.device)],
            [lens[s] for s in group],
            scale,
            read,
        )
        if identity:
            result.copy_(out_rows)
        else:
            result[index] = out_rows.to(result.dtype)
    return result


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    lens = [int(x) for x in seq_lens.tolist()]
    seqs = list(range(len(lens)))
    read = KVRead(query.dtype, k_scale, v_scale)
    return _decode(query, key_cache, value_cache, block_tables, lens, seqs, scale, out, read)
