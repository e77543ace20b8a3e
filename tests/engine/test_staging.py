"""Host staging helpers: `host_tensor` equals `torch.tensor`, and `StagedTables` rows always
hold the current block tables however they changed between steps."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.engine.worker.staging import StagedTables, host_tensor


@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_host_tensor_equals_torch_tensor(dtype) -> None:
    for values in ([], [0], [5, -3, 2**31 - 1], list(range(1000))):
        got = host_tensor(values, dtype)
        assert got.dtype == dtype
        assert torch.equal(got, torch.tensor(values, dtype=dtype))


def _check(staged: StagedTables, tables: list[list[int]]) -> None:
    width = staged.update(tables)
    assert width == max(len(t) for t in tables)
    for i, t in enumerate(tables):
        assert staged.buf[i, : len(t)].tolist() == t, f"row {i}"


def test_rows_follow_every_kind_of_change() -> None:
    """Random steps of a decode batch: blocks appended, the last one replaced (copy-on-write),
    whole tables replaced (swap in, recompute), sequences finishing and joining anywhere in the
    batch, tables rebuilt as equal new lists (as a tensor-parallel worker receives them)."""
    rng = random.Random(0)
    rows, width = 24, 12
    staged = StagedTables(torch.full((rows, width), -7, dtype=torch.int32))
    next_block = iter(range(10**6))
    batch = [[next(next_block) for _ in range(rng.randrange(1, 4))] for _ in range(16)]
    for _ in range(300):
        _check(staged, batch)
        for t in batch:
            r = rng.random()
            if r < 0.2 and len(t) < width:
                t.append(next(next_block))
            elif r < 0.25:
                t[-1] = next(next_block)  # copy-on-write of the last block
            elif r < 0.28 and len(t) < width:
                t[-1] = next(next_block)  # copy-on-write, then a new block
                t.append(next(next_block))
        r = rng.random()
        if r < 0.2 and len(batch) > 1:
            del batch[rng.randrange(len(batch))]  # finished: the rows after it move up
        elif r < 0.35 and len(batch) < rows:
            new = [next(next_block) for _ in range(rng.randrange(1, width))]
            batch.insert(rng.randrange(len(batch) + 1), new)  # joined (or swapped back in)
        elif r < 0.4:
            k = rng.randrange(len(batch))
            batch[k] = [next(next_block) for _ in range(len(batch[k]))]  # swapped: a new list
        elif r < 0.45:
            batch = [list(t) for t in batch]  # equal content, new lists (pickled, as a TP rank)
        elif r < 0.5:
            rng.shuffle(batch)


def test_shorter_table_in_a_row_keeps_its_prefix_right() -> None:
    staged = StagedTables(torch.zeros((2, 6), dtype=torch.int32))
    _check(staged, [[1, 2, 3, 4], [5]])
    _check(staged, [[9, 2], [5, 6]])
    _check(staged, [[9, 2, 3], [7, 6, 8, 1, 2, 3]])
