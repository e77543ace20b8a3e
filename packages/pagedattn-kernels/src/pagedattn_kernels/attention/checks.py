"""Input checks of the attention ops (both backends), run before anything is written.

Shapes, dtypes and devices are always checked; lengths, ``cu_query_lens`` and block ids only
when they live on the CPU (see ``pagedattn_kernels.common``). A valid call goes through one
boolean expression (:func:`_attention_ok`) so that checking a decode step costs a few
microseconds; anything else goes through the detailed checks, which say what is wrong.
"""

from __future__ import annotations

import math

import torch

from pagedattn_kernels.attention.triton_launch import MAX_HEAD_DIM
from pagedattn_kernels.common import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    FP8_DTYPE,
    INDEX_DTYPES,
    check_caches,
    check_float,
    check_fp8_triton,
    check_index,
    check_same_device,
    check_unit_stride,
    fail,
)


def _attention_ok(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor | None,
    out: torch.Tensor | None,
    scale: float | None,
    max_query_len: int | None,
    max_seq_len: int | None,
) -> bool:
    """Every shape/dtype/device rule of ``check_attention`` in one expression: the per-call
    cost of checking a valid decode step stays a few microseconds. False sends the call
    through the detailed checks, which say what is wrong."""
    try:
        device = key_cache.device
        shape = key_cache.shape
        dtype = key_cache.dtype
        num_seqs = seq_lens.shape[0]
        return (
            len(shape) == 4
            and value_cache.shape == shape
            and dtype in CACHE_DTYPES
            and value_cache.dtype == dtype
            and query.dtype in FLOAT_DTYPES
            and (query.dtype == dtype or dtype == FP8_DTYPE)
            and query.dim() == 3
            and query.shape[2] == shape[3]
            and query.shape[1] > 0
            and query.shape[1] % shape[2] == 0
            and min(shape[1:]) > 0
            and seq_lens.dim() == 1
            and seq_lens.dtype in INDEX_DTYPES
            and block_tables.dim() == 2
            and block_tables.shape[0] == num_seqs
            and block_tables.dtype in INDEX_DTYPES
            and value_cache.device == device
            and query.device == device
            and seq_lens.device == device
            and block_tables.device == device
            and (
                query.shape[0] == num_seqs
                if cu_query_lens is None
                else (
                    cu_query_lens.dim() == 1
                    and cu_query_lens.shape[0] == num_seqs + 1
                    and cu_query_lens.dtype in INDEX_DTYPES
                    and cu_query_lens.device == device
                )
            )
            and (
                out is None
                or (out.shape == query.shape and out.dtype == query.dtype and out.device == device)
            )
            and scale is None
            and (max_query_len is None or (type(max_query_len) is int and max_query_len >= 0))
            and (max_seq_len is None or (type(max_seq_len) is int and max_seq_len >= 0))
        )
    except (AttributeError, TypeError, IndexError):
        return False


def check_attention(
    op: str,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor | None,
    out: torch.Tensor | None,
    scale: float | None,
    max_query_len: int | None,
    max_seq_len: int | None,
) -> None:
    if _attention_ok(
        query, key_cache, value_cache, block_tables, seq_lens, cu_query_lens, out,
        scale, max_query_len, max_seq_len,
    ):  # fmt: skip
        if key_cache.device.type == "cpu":
            nb, bs = key_cache.shape[:2]
            _check_values(op, query, block_tables, seq_lens, cu_query_lens, nb, bs, max_seq_len)
        return
    nb, bs, hkv, d = check_caches(op, key_cache, value_cache)
    check_float(op, "query", query, 3)
    if query.shape[2] != d:
        raise fail(op, f"query head dim {query.shape[2]} differs from the caches' {d}")
    if query.dtype != key_cache.dtype and key_cache.dtype != FP8_DTYPE:
        raise fail(op, f"query is {query.dtype} but the caches are {key_cache.dtype}")
    num_heads = query.shape[1]
    if num_heads == 0 or num_heads % hkv:
        raise fail(op, f"num_heads {num_heads} must be a positive multiple of num_kv_heads {hkv}")
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    check_index(op, "seq_lens", seq_lens, (None,))
    check_index(op, "block_tables", block_tables, (num_seqs, None))
    devices = {"seq_lens": seq_lens, "block_tables": block_tables, "query": query}
    if cu_query_lens is not None:
        check_index(op, "cu_query_lens", cu_query_lens, (num_seqs + 1,))
        devices["cu_query_lens"] = cu_query_lens
    elif query.shape[0] != num_seqs:
        raise fail(op, f"query has {query.shape[0]} rows but there are {num_seqs} sequences")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != query.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise fail(op, f"out must have the query's shape {tuple(query.shape)}, got {got}")
        if out.dtype != query.dtype:
            raise fail(op, f"out is {out.dtype}, the query {query.dtype}")
        devices["out"] = out
    check_same_device(op, key_cache.device, **devices)
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise fail(op, f"scale must be a finite number, got {scale!r}")
    for name, hint in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if hint is not None and (not isinstance(hint, int) or hint < 0):
            raise fail(op, f"{name} must be a non-negative int (a host-side hint), got {hint!r}")
    if key_cache.device.type == "cpu":
        _check_values(op, query, block_tables, seq_lens, cu_query_lens, nb, bs, max_seq_len)


def _check_values(
    op: str,
    query: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_query_lens: torch.Tensor | None,
    num_blocks: int,
    block_size: int,
    max_seq_len: int | None,
) -> None:
    """The values of CPU metadata (a GPU check would cost a device sync). Each rule is tested
    on all sequences at once; only a failure looks for the first sequence that breaks it (a
    per-sequence loop cost ~20 ms of a 64-sequence CPU step over 30 layers)."""
    lens = seq_lens.to(torch.int64)
    if cu_query_lens is None:  # decode: length 0 is allowed (batch padding)
        q_lens = torch.zeros_like(lens)
    else:
        cu = cu_query_lens.to(torch.int64)
        if cu.numel() and (int(cu[0]) != 0 or int(cu[-1]) != query.shape[0]):
            raise fail(
                op,
                f"cu_query_lens must start at 0 and end at the {query.shape[0]} query rows, "
                f"got {int(cu[0])}..{int(cu[-1])}",
            )
        q_lens = cu[1:] - cu[:-1]
    width = block_tables.shape[1]
    need = (lens + block_size - 1) // block_size
    used = torch.arange(width)[None, :] < need[:, None]
    table = block_tables.to(torch.int64)
    bad_block = used & ((table < 0) | (table >= num_blocks))
    rules = [
        q_lens < 0,
        lens < q_lens,
        lens > width * block_size,
        (lens > max_seq_len) if max_seq_len is not None else torch.zeros_like(lens, dtype=torch.bool),
        bad_block.any(dim=1),
    ]
    broken = torch.stack(rules).any(dim=0)
    if not bool(broken.any()):
        return
    i = int(broken.nonzero()[0, 0])
    seq_len, q_len = int(lens[i]), int(q_lens[i])
    if q_len < 0:
        raise fail(op, f"cu_query_lens decreases at sequence {i}")
    if seq_len < q_len:
        raise fail(op, f"sequence {i}: seq_lens {seq_len} < its {q_len} query tokens")
    if seq_len > width * block_size:
        raise fail(
            op,
            f"sequence {i}: {seq_len} tokens need {-(-seq_len // block_size)} blocks but "
            f"block_tables has {width} columns",
        )
    if max_seq_len is not None and seq_len > max_seq_len:
        raise fail(op, f"sequence {i}: seq_lens {seq_len} > max_seq_len hint {max_seq_len}")
    row = table[i, : int(need[i])]
    raise fail(
        op,
        f"sequence {i}: block_tables points at blocks {int(row.min())}.."
        f"{int(row.max())} but the caches hold {num_blocks}",
    )

def check_triton_attention(
    op: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    out: torch.Tensor,
) -> None:  # fmt: skip
    """What only the Triton kernels need: head dims up to ``MAX_HEAD_DIM``, unit strides on
    the head dim of the caches and the output (the query is made contiguous if it is not), and
    for fp8 caches a GPU that converts fp8 (see ``common.check_fp8_triton``)."""
    if key_cache.dtype == FP8_DTYPE:
        check_fp8_triton(op, key_cache.device)
    if (
        query.shape[2] <= MAX_HEAD_DIM
        and key_cache.stride(-1) == 1
        and value_cache.stride(-1) == 1
        and out.stride(-1) == 1
    ):
        return
    if query.shape[2] > MAX_HEAD_DIM:
        raise fail(
            op, f"the Triton kernels take head dims up to {MAX_HEAD_DIM}; use backend='torch'"
        )
    check_unit_stride(op, key_cache=key_cache, value_cache=value_cache, out=out)


def check_new_kv(
    op: str,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
) -> None:
    """``key``/``value`` of paged_attention: both or neither, ``[num_tokens, num_kv_heads,
    head_dim]`` like the query's rows and the caches' heads, of the caches' (float) dtype and
    device, unit stride on the head dim."""
    if key is None or value is None:
        raise fail(op, "key and value go together: give both or neither")
    if key_cache.dtype == FP8_DTYPE:
        raise fail(op, "key/value must hold the caches' values; an fp8 cache holds rounded ones "
                       "(leave key/value out)")  # fmt: skip
    want = (query.shape[0], key_cache.shape[2], key_cache.shape[3])
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise fail(op, f"{name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise fail(op, f"{name} must have shape {want} (query rows, kv heads, head dim), "
                           f"got {tuple(t.shape)}")  # fmt: skip
        if t.dtype != key_cache.dtype:
            raise fail(op, f"{name} is {t.dtype} but the caches are {key_cache.dtype}")
        if t.device != key_cache.device:
            raise fail(op, f"{name} is on {t.device} but the caches are on {key_cache.device}")
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise fail(op, f"{name} needs unit stride on the head dim and heads packed "
                           f"together, got strides {tuple(t.stride())}")  # fmt: skip
