"""Helpers for testing code that uses these kernels: random paged batches, error measures.

A random batch scatters each sequence's blocks over the cache in random physical order and
fills unused block-table entries with ids past the end of the cache, so any kernel that reads
blocks it should not, or reads blocks in logical order by mistake, gives a wrong answer (or a
clear error) instead of a lucky right one.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# Largest allowed ||out - ref|| / ||ref|| against the float64 reference, by dtype.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-3,
    torch.float16: 3e-3,
    torch.bfloat16: 1e-2,
}

SEED_ENV = "PAGEDATTN_TEST_SEED"


def fresh_seed() -> int:
    """A new random seed, or ``$PAGEDATTN_TEST_SEED`` to replay a failure."""
    fixed = os.environ.get(SEED_ENV)
    return int(fixed) if fixed else secrets.randbits(48)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in ``out`` gives inf."""
    out64 = out.to(device=ref.device, dtype=torch.float64)
    if not bool(torch.isfinite(out64).all()):
        return float("inf")
    denom = float(ref.norm())
    return float((out64 - ref).norm()) / (denom if denom > 0 else 1.0)


@dataclass(slots=True)
class PagedBatch:
    """Inputs of ``paged_attention`` (and, with one query per sequence, of decode)."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    cu_query_lens: torch.Tensor  # [num_seqs + 1] int32
    lens: list[int]
    query_lens: list[int]


def random_paged_batch(
    gen: torch.Generator,
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random caches holding every sequence's context in randomly ordered physical blocks.

    ``gen`` must live on ``device``. Unused block-table entries point past the cache.
    """
    device = torch.device(device)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    width = max([*per_seq, 1]) + 1
    table = [[num_blocks + 1000 + c for c in range(width)] for _ in seq_lens]
    used = iter(order)
    for i, n in enumerate(per_seq):
        for c in range(n):
            table[i][c] = next(used)
    num_tokens = sum(query_lens)
    query = torch.randn(
        (num_tokens, num_heads, head_dim), generator=gen, device=device, dtype=torch.float32
    ).to(dtype)
    cu = [0, *itertools.accumulate(query_lens)]
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=torch.tensor(table, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        lens=list(seq_lens),
        query_lens=list(query_lens),
    )


def own_rows(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
             query_lens: list[int]) -> torch.Tensor:  # fmt: skip
    """The cache rows of the query tokens themselves, ``[sum(query_lens), kv_heads, dim]``:
    sequence i's positions ``seq_lens[i] - query_lens[i] ..``, as a step's ``key`` / ``value``
    arguments of ``paged_attention`` hold them."""
    block_size = cache.shape[1]
    rows = []
    for i, (n, q) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pos = torch.arange(n - q, n, device=cache.device)
        blocks = block_tables[i].to(cache.device).long()[pos // block_size]
        rows.append(cache[blocks, pos % block_size])
    if not rows:
        return cache.new_empty((0, *cache.shape[2:]))
    return torch.cat(rows).contiguous()


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel fails to write fails the test."""
    return torch.full_like(t, float("nan"))


#: (head_dim, dtype, block_size, queries per KV head): every head size with every dtype once,
#: block sizes 8/16/32 and GQA ratios 1 (MHA), 3, 4, 8 spread over them. Shared by the decode
#: and prefill tests so both cover the same grid.
ATTENTION_CASES: list[tuple[int, torch.dtype, int, int]] = [
    (64, torch.float32, 16, 1),
    (64, torch.bfloat16, 8, 8),
    (64, torch.float16, 32, 3),
    (80, torch.bfloat16, 8, 3),
    (80, torch.float32, 32, 4),
    (80, torch.float16, 16, 1),
    (96, torch.float16, 32, 4),
    (96, torch.bfloat16, 16, 1),
    (96, torch.float32, 8, 8),
    (128, torch.bfloat16, 16, 4),
    (128, torch.float32, 8, 3),
    (128, torch.float16, 32, 8),
    (256, torch.float32, 16, 8),
    (256, torch.bfloat16, 32, 1),
    (256, torch.float16, 8, 4),
]


def attention_case_id(case: tuple[int, torch.dtype, int, int]) -> str:
    """A readable pytest id for one of `ATTENTION_CASES`."""
    head_dim, dtype, block_size, group = case
    return f"d{head_dim}-{str(dtype).removeprefix('torch.')}-bs{block_size}-g{group}"


_SAME_WIDTH_INT = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance between two tensors of one float dtype in units in the last place:
    how many representable values of that dtype lie between them (0 = bit-identical, or +0 and
    -0). int64, on ``a``'s device. NaN or inf compares as a huge distance to any finite value."""
    if a.dtype != b.dtype or a.dtype not in _SAME_WIDTH_INT:
        raise ValueError(f"ulp_distance takes two float32/float16/bfloat16 tensors of one dtype, "
                         f"got {a.dtype} and {b.dtype}")  # fmt: skip
    as_int = _SAME_WIDTH_INT[a.dtype]
    sign_bit = 1 << (torch.finfo(a.dtype).bits - 1)

    def ordered(t: torch.Tensor) -> torch.Tensor:
        # Sign-magnitude bits -> integers in the same order as the floats they encode.
        i = t.contiguous().view(as_int).to(torch.int64)
        return torch.where(i < 0, -(i + sign_bit), i)

    return (ordered(a) - ordered(b.to(a.device))).abs()


def rejected_unchanged(fn, *tensors: torch.Tensor) -> str:
    """Call ``fn``, which must raise ValueError, and check that ``tensors`` are unchanged (a
    bad input changes nothing); returns the error's message."""
    import pytest

    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError) as info:
        fn()
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b), "a rejected call must not write"
    return str(info.value)


@contextmanager
def compiled_kernels() -> Iterator[list[str]]:
    """The names of the Triton kernel variants compiled inside the block, in order (Triton's
    post-compile hook, chained to any hook already set). A test that a batch shape compiles
    nothing new asserts the list is empty; a benchmark reports a compile inside its timed run
    (a pass stalled for about a second). Stays empty without triton, or with a triton that
    has no compile hook (before 3.4)."""
    names: list[str] = []
    try:
        from triton import knobs

        runtime = knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield names
        return

    def hook(*args: Any, **kwargs: Any) -> Any:
        names.append(getattr(kwargs.get("fn"), "name", "?"))
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        runtime.jit_post_compile_hook = previous
