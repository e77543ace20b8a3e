"""Host-side helpers that turn the scheduler's Python lists into input tensors cheaply.

On a GPU a decode step of a large batch is a CUDA-graph replay of a few milliseconds, and the
host work around it is time the GPU waits; these helpers keep that work small:

- `host_tensor`: a CPU tensor of Python ints through the buffer protocol (`array` converts
  the list in C, several times faster than `torch.tensor(list)` for batch-sized lists).
- `to_device` / `stage`: ints or a host tensor on the device through pinned memory, never
  waiting for the stream.
- `StagedTables`: the block tables of the decode batch in one (pinned) host buffer, kept from
  step to step and rewritten only where they changed.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import compress
from operator import ne

import torch

_TYPECODES = {torch.long: "q", torch.int32: "i"}
assert array("q").itemsize == 8 and array("i").itemsize == 4


def host_tensor(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` for a list of ints (dtype long or int32), faster.

    The tensor shares memory with a fresh `array`, which it keeps alive."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_TYPECODES[dtype], values), dtype=dtype)


def to_device(values: list[int], device: torch.device, dtype: torch.dtype = torch.long
              ) -> torch.Tensor:
    """`values` as a tensor on `device`, without making the host wait for the device
    (`stage`)."""
    return stage(host_tensor(values, dtype), device)


def stage(t, device: torch.device):
    """The host tensor `t` (or anything with `pin_memory` and `to`, such as a
    `pagedattn_kernels.DecodePlan`) on `device`, without making the host wait for the device.

    On a GPU it goes through pinned memory (PyTorch's caching host allocator, which keeps the
    block until the copy has run): a copy from pageable memory "may synchronize with the
    stream" (CUDA's API synchronization behavior), that is, wait for every kernel queued
    before it. With asynchronous scheduling the next pass is prepared while the one before
    runs; a pageable copy would hold the host there until that pass ends, and the GPU would
    then wait for the rest of the preparation and the launches."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class StagedTables:
    """Block tables of the decode batch, row by row in `buf`, rewritten only where they changed.

    From one decode step to the next most block tables are unchanged: a sequence gains a block
    every `block_size` tokens, copy-on-write replaces its last block, and when a sequence
    finishes the ones after it move up a row. Packing every table each step converts every
    block id of the batch (about 10,000 for 512 sequences of 300 tokens); here each row
    remembers the table it holds, rows whose table was staged in another row are copied inside
    the buffer, and only the entries that differ are written. Any change of a table is found
    (rows are compared by content), so this relies on nothing about how tables change.

    Rows are left-aligned and entries past a table's end are left as they are: no kernel reads
    a block table past its sequence's length.
    """

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        rows = buf.shape[0]
        # Per row: the block-table list last staged there (held, so that its id stays unique)
        # and a copy of its content then, which is what the row holds.
        self._lists: list[list[int] | None] = [None] * rows
        self._staged: list[list[int]] = [[] for _ in range(rows)]

    def update(self, tables: Sequence[list[int]]) -> int:
        """Make rows `[0, len(tables))` hold `tables`; returns the longest table's length."""
        n = len(tables)
        tables = list(tables)
        lists = self._lists
        # List comparisons run in C and compare items by identity first: cheap when unchanged.
        if tables != lists[:n]:
            self._move_rows(tables)
        staged = self._staged
        width = self.buf.shape[1]
        index: list[int] = []
        values: list[int] = []
        for i in compress(range(n), map(ne, tables, staged)):  # the rows that changed
            t = tables[i]
            j = _common_prefix(staged[i], t)
            base = i * width
            index.extend(range(base + j, base + len(t)))
            values.extend(t[j:])
            staged[i] = t.copy()
        if index:
            self.buf.view(-1)[host_tensor(index)] = host_tensor(values, self.buf.dtype)
        lists[:n] = tables
        return max(map(len, tables))

    def _move_rows(self, tables: Sequence[list[int]]) -> None:
        """Copy, inside the buffer, the rows of tables that were staged in another row (the
        sequences before them finished, or others joined the batch)."""
        lists = self._lists
        where = {id(t): i for i, t in enumerate(lists) if t is not None}
        dst: list[int] = []
        src: list[int] = []
        for i, t in enumerate(tables):
            if t is not lists[i]:
                j = where.get(id(t))
                if j is not None:
                    dst.append(i)
                    src.append(j)
        if dst:
            buf = self.buf
            width = max(len(self._staged[j]) for j in src)  # the rest of a row is never read
            buf[host_tensor(dst), :width] = buf[host_tensor(src), :width]
            before = self._staged.copy()
            for i, j in zip(dst, src):
                self._staged[i] = before[j]


def _common_prefix(old: list[int], new: list[int]) -> int:
    """A length k with `new[:k] == old[:k]`: all of `old` but its last block when `new` only
    appended blocks or replaced the last one (copy-on-write), the usual changes; else 0."""
    k = len(old) - 1
    if 0 < k <= len(new) and new[:k] == old[:k]:
        return k
    return 0
