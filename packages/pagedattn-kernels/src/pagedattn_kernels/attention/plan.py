"""Decode work plans: which program attends which part of which sequence.

Flash-decoding as ``paged_decode_attention`` does it without a plan gives every sequence of a
batch the same number of programs (the split count), each taking an equal share of its own
context. With equal contexts that balances. A serving batch holds contexts of tens and of
thousands of tokens: a long one's programs then walk many more tiles than the rest, and the
step waits for them after every other program has finished. On an H200 with the contexts of
a real ShareGPT run, decode attention on the fp8 cache took 33.8 us at 32 sequences against
18.4 us for equal contexts of the same mean, and 113.0 against 94.8 us at 384 sequences
(``docs/performance/gpu_runs/2026-12-02f/``).

A plan cuts each sequence into chunks of at most ``chunk`` tokens, the same bound for every
sequence, chosen from the whole batch (``chunk_size``): the work one program slot gets on
average (rounded up to whole tiles, and at least ``MIN_CHUNK``). The chunks of a split
sequence write partial outputs, which ``decode_merge_kernel`` merges; a sequence of one chunk
writes its output directly. The chunks are listed longest first (list scheduling's longest
processing time first rule), so the long ones start at once and the short ones fill in.

This is FlashInfer's plan-then-run split of a decode call: the plan is host work on lengths
the host already knows (a scheduler knows every context length), a few numpy operations
per step, and the run reads it from two small int32 tensors, so a CUDA graph captured with a plan of
fixed capacity (``capacity``, ``decode_plan_capacity``) replays any later plan of the same
batch size.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedattn_kernels.common import FP8_DTYPE, fail

#: The fewest tokens a chunk of a split sequence holds (rounded up to whole tiles): shorter
#: chunks cost a program's fixed latency and a merge for little work.
MIN_CHUNK = 128
#: The most chunks one sequence is cut into (the merge kernel's PARTS_PAD).
MAX_CHUNKS = 64


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """``work`` (int32 ``[capacity, 4]``): one item per program of each KV head, longest
    first: the query row, the chunk's first and end context positions, and the row of the
    partial buffers it writes (-1: the row's whole context, written to the output directly).
    Rows past the items are padding (row -1). ``merges`` (int32 ``[merge_capacity, 3]``): per
    split sequence, its query row, its first partial row and how many (contiguous) partial
    rows it has; padding rows -1. ``tile_n``: the kernel tile the chunks are multiples of
    (the launch must use the same configuration)."""

    work: torch.Tensor
    merges: torch.Tensor
    tile_n: int

    def to(self, device: torch.device, non_blocking: bool = False) -> DecodePlan:
        return DecodePlan(self.work.to(device, non_blocking=non_blocking),
                          self.merges.to(device, non_blocking=non_blocking), self.tile_n)  # fmt: skip

    def pin_memory(self) -> DecodePlan:
        """This host plan in pinned memory, as ``Tensor.pin_memory``: a copy to a GPU from
        there with ``non_blocking`` never waits for the kernels queued before it."""
        return DecodePlan(self.work.pin_memory(), self.merges.pin_memory(), self.tile_n)

    @property
    def num_items(self) -> int:
        """Items in the plan (host plans only: it reads the rows)."""
        return int((self.work[:, 0] >= 0).sum())


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def chunk_size(lens: Sequence[int], lanes: int, tile_n: int, min_chunk: int = MIN_CHUNK) -> int:
    """The longest chunk of a plan over contexts ``lens`` for ``lanes`` program slots per KV
    head: the average work of a slot (the total over ``lanes``), so that no program holds
    more than its share and the chunks number at most ``len(lens) + lanes`` (two waves at
    most when the rows fit one); at least ``min_chunk`` and ``1 / MAX_CHUNKS`` of the longest
    context; a multiple of ``tile_n``.

    (A first version kept small batches to one wave of chunks, the rest being mostly fixed
    latency. With nearly as many rows as lanes that left no room to split the long ones: on
    an H200 with real ShareGPT contexts at 128 sequences, 4 rows split and 79.3 us against
    the bfloat16 cache's 56.1.)"""
    return _chunk(sum(lens), max(lens, default=0), lanes, tile_n, min_chunk)


def _chunk(total: int, longest: int, lanes: int, tile_n: int, min_chunk: int) -> int:
    chunk = max(-(-total // max(lanes, 1)), min_chunk, -(-longest // MAX_CHUNKS), 1)
    return min(_round_up(chunk, tile_n), max(_round_up(longest, tile_n), tile_n))


def capacity(num_seqs: int, lanes: int) -> tuple[int, int]:
    """The most items and merges a plan of ``num_seqs`` rows over ``lanes`` can have (what a
    CUDA graph's static plan buffers hold): ``chunk_size`` keeps the chunks to ``num_seqs +
    lanes`` (one per row, plus at most the total over the chunk length), and a split row
    takes at least one of the extra ones."""
    return num_seqs + lanes, min(num_seqs, lanes)


def build_plan(
    seq_lens: Sequence[int] | torch.Tensor, lanes: int, tile_n: int,
    size: tuple[int, int] | None = None, min_chunk: int = MIN_CHUNK,
) -> DecodePlan:  # fmt: skip
    """The plan (host tensors) of a decode batch with contexts ``seq_lens`` (host ints; 0 for
    a padding row, which gets one empty item: its output is zeros). ``size``: pad ``work`` and
    ``merges`` to these many rows (``capacity``), else exactly as many as needed.

    numpy, not torch ops: a plan is built on the host for every decode step, and a dozen
    small torch calls cost several times its few microseconds of numpy."""
    if isinstance(seq_lens, torch.Tensor):
        lens = seq_lens.to("cpu", torch.int64).reshape(-1).numpy()
    else:
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if lens.size and lens.min() < 0:
        raise ValueError("build_plan: context lengths must be >= 0")
    chunk = _chunk(int(lens.sum()), int(lens.max(initial=0)), lanes, tile_n, min_chunk)
    counts = np.maximum((lens + chunk - 1) // chunk, 1)
    # every chunk of a row but its last: the row's own length shared evenly, in whole tiles
    per = ((lens + counts - 1) // counts + tile_n - 1) // tile_n * tile_n
    rows = np.repeat(np.arange(lens.size), counts)
    firsts = np.cumsum(counts) - counts
    start = (np.arange(rows.size) - firsts[rows]) * per[rows]
    end = np.minimum(start + per[rows], lens[rows])
    split = counts[rows] > 1
    partial = np.where(split, np.cumsum(split) - 1, -1)
    order = np.argsort(start - end, kind="stable")  # longest first, ties in row order
    work = np.stack([rows, start, end, partial], axis=1)[order]
    split_rows = np.flatnonzero(counts > 1)
    merges = np.stack([split_rows, partial[firsts[split_rows]], counts[split_rows]], axis=1)
    if size is not None:
        work = _pad(work, size[0], "items")
        merges = _pad(merges, size[1], "merges")
    return DecodePlan(torch.from_numpy(work.astype(np.int32)),
                      torch.from_numpy(merges.astype(np.int32)), tile_n)  # fmt: skip


def _pad(t: np.ndarray, rows: int, what: str) -> np.ndarray:
    if t.shape[0] > rows:
        raise ValueError(f"build_plan: {t.shape[0]} {what} do not fit a capacity of {rows}")
    out = np.full((rows, t.shape[1]), -1, dtype=np.int64)
    out[: t.shape[0]] = t
    return out


def plan_decode(
    seq_lens: Sequence[int] | torch.Tensor,
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    padded: bool = False,
    min_chunk: int | None = None,
) -> DecodePlan:
    """The work plan of a decode call over rows of context lengths ``seq_lens`` (host ints or
    a CPU tensor; 0 for a padding row), for a query of ``dtype`` with ``num_kv_heads`` KV
    heads of ``head_dim`` on a cache of ``kv_dtype`` on ``device``: the chunks each program
    attends, longest first (``attention.plan``). Host tensors: move them to ``device`` (or
    copy them into a CUDA graph's static ones) before the call. ``padded``: sized to
    :func:`decode_plan_capacity`, as a CUDA graph's buffers are. ``min_chunk``: the fewest
    tokens of a split row's chunk (``plan.MIN_CHUNK``)."""
    from pagedattn_kernels.attention import triton_launch  # it imports this module

    op = "plan_decode"
    _check_heads(op, num_kv_heads, head_dim)
    if min_chunk is not None and (type(min_chunk) is not int or min_chunk < 1):
        raise fail(op, f"min_chunk must be a positive int, got {min_chunk!r}")
    num_seqs = seq_lens.numel() if isinstance(seq_lens, torch.Tensor) else len(seq_lens)
    cfg, lanes = triton_launch.decode_lanes(num_seqs, num_kv_heads, head_dim, dtype, kv_dtype,
                                            torch.device(device))  # fmt: skip
    try:
        return build_plan(
            seq_lens, lanes, cfg.tile_n,
            size=capacity(num_seqs, lanes) if padded else None,
            min_chunk=MIN_CHUNK if min_chunk is None else min_chunk,
        )  # fmt: skip
    except ValueError as exc:
        raise fail(op, str(exc).removeprefix("build_plan: ")) from None


def decode_plan_capacity(
    num_seqs: int, *, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    kv_dtype: torch.dtype, device: torch.device,
) -> tuple[int, int]:  # fmt: skip
    """The rows of a padded plan's ``work`` and ``merges`` for ``num_seqs`` rows: the most any
    plan of that many rows needs (a CUDA graph's static plan buffers)."""
    from pagedattn_kernels.attention import triton_launch

    _check_heads("decode_plan_capacity", num_kv_heads, head_dim)
    _, lanes = triton_launch.decode_lanes(num_seqs, num_kv_heads, head_dim, dtype, kv_dtype,
                                          torch.device(device))  # fmt: skip
    return capacity(num_seqs, lanes)


def _check_heads(op: str, num_kv_heads: int, head_dim: int) -> None:
    if type(num_kv_heads) is not int or type(head_dim) is not int or min(num_kv_heads,
                                                                          head_dim) < 1:
        raise fail(op, f"num_kv_heads and head_dim must be positive ints, got "
                       f"{num_kv_heads!r}, {head_dim!r}")  # fmt: skip


#: Where plans pay, in (sequence, KV head) pairs: at most this many. On an H200 with the
#: contexts of a real ShareGPT run (Llama-3-8B heads, CUDA graphs, against the longest-first
#: order and the automatic splits; ``docs/performance/gpu_runs/2026-12-02h/``), fp8 caches'
#: attention alone ran 1.2-1.8x as fast at 16-256 sequences, 1.09x at 384 and 0.95x at 768;
#: bfloat16 caches 1.15-1.6x at 16-64 sequences and 0.97-0.99x from 128, where the one-wave
#: programs of wide tiles already balance. In the fp8 run itself (e8704b8, plans up to 512
#: sequences) the passes of 65-256 sequences took 6.51 against 6.82 ms and those of 1-64
#: 3.63 against 3.73, but those of 257-512 11.02 against 10.86: there, with few rows split,
#: the plan's padding items and merge programs cost more than the balance gains. So fp8
#: plans stop at 256 sequences. ``PAGEDATTN_PLAN_MAX_PAIRS_FP8`` / ``_16BIT`` (read at import)
#: move the bounds, for A/B runs.
PLAN_MAX_PAIRS_FP8 = int(os.environ.get("PAGEDATTN_PLAN_MAX_PAIRS_FP8", str(256 * 8)))
PLAN_MAX_PAIRS_16BIT = int(os.environ.get("PAGEDATTN_PLAN_MAX_PAIRS_16BIT", str(64 * 8)))


def decode_plan_pays(num_seqs: int, *, num_kv_heads: int, kv_dtype: torch.dtype) -> bool:
    """Whether a decode call of ``num_seqs`` rows on a ``kv_dtype`` cache runs faster by a plan
    than by the automatic splits and the longest-first order (``PLAN_MAX_PAIRS_FP8``)."""
    most = PLAN_MAX_PAIRS_FP8 if kv_dtype == FP8_DTYPE else PLAN_MAX_PAIRS_16BIT
    return num_seqs * num_kv_heads <= most
