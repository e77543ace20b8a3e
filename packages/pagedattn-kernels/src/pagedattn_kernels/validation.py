"""Input checks shared by both backends. Every check runs before anything is written, so a
rejected call changes nothing.

Shapes, dtypes and devices are always checked. Values (slot ids, block ids, lengths) are
checked only when they live on the CPU, where reading them is free; on CUDA that would cost a
device sync per call, so there the caller is trusted (documented in the README).
"""

from __future__ import annotations

import itertools
import math

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def fail(op: str, message: str) -> ValueError:
    return ValueError(f"{op}: {message}")


def check_float(op: str, name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise fail(op, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise fail(op, f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_index(op: str, name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """Integer tensor of the given shape (None = any size in that dim)."""
    if not isinstance(t, torch.Tensor):
        raise fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise fail(op, f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape)
    ):
        want_s = ", ".join("*" if w is None else str(w) for w in shape)
        raise fail(op, f"{name} must have shape [{want_s}], got {tuple(t.shape)}")


def check_same_device(op: str, device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise fail(op, f"{name} is on {t.device} but the caches are on {device}; move it")


def check_caches(
    op: str, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> tuple[int, int, int, int]:
    """Both caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, same shape and dtype."""
    check_float(op, "key_cache", key_cache, 4)
    check_float(op, "value_cache", value_cache, 4)
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise fail(
            op,
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype} and value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype} must match in shape and dtype",
        )
    if value_cache.device != key_cache.device:
        raise fail(op, "key_cache and value_cache must be on one device")
    nb, bs, hkv, d = key_cache.shape
    if bs <= 0 or hkv <= 0 or d <= 0:
        raise fail(op, f"cache shape {tuple(key_cache.shape)} has an empty dimension")
    return nb, bs, hkv, d


def check_unit_stride(op: str, **tensors: torch.Tensor) -> None:
    """The Triton kernels address the head dim with stride 1."""
    for name, t in tensors.items():
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise fail(op, f"{name} needs stride 1 in its last dim (got {t.stride(-1)})")


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


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    op = "reshape_and_cache"
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
            and dtype in FLOAT_DTYPES
            and value_cache.dtype == dtype
            and query.dtype == dtype
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
                or (out.shape == query.shape and out.dtype == dtype and out.device == device)
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
    if query.dtype != key_cache.dtype:
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
    lens = seq_lens.tolist()
    if cu_query_lens is None:  # decode: length 0 is allowed (batch padding)
        q_lens = [0] * len(lens)
    else:
        cu = cu_query_lens.tolist()
        if cu and (cu[0] != 0 or cu[-1] != query.shape[0]):
            raise fail(
                op,
                f"cu_query_lens must start at 0 and end at the {query.shape[0]} query rows, "
                f"got {cu[0]}..{cu[-1]}",
            )
        q_lens = [b - a for a, b in itertools.pairwise(cu)]
    width = block_tables.shape[1]
    for i, (seq_len, q_len) in enumerate(zip(lens, q_lens)):
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
        used = block_tables[i, : -(-seq_len // block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
            raise fail(
                op,
                f"sequence {i}: block_tables points at blocks {int(used.min())}.."
                f"{int(used.max())} but the caches hold {num_blocks}",
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
