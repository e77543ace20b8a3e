"""Host staging helpers: `host_tensor` equals `torch.tensor`; `stage` copies through pinned
memory on a GPU, so that a mixed pass's inputs never wait for the pass before (checked on a GPU
with a long kernel queued); and `StagedTables` rows always hold the current block tables
however they changed between steps."""

from __future__ import annotations

import random
import time

import pytest
import torch

import pagedattn_kernels
from pagedkv.engine.worker.inputs import StepBatch, build_inputs
from pagedkv.engine.worker.staging import StagedTables, host_tensor, stage


@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_host_tensor_equals_torch_tensor(dtype) -> None:
    for values in ([], [0], [5, -3, 2**31 - 1], list(range(1000))):
        got = host_tensor(values, dtype)
        assert got.dtype == dtype
        assert torch.equal(got, torch.tensor(values, dtype=dtype))


class _Recorder:
    """Stands for a host tensor: records how `stage` moves it."""

    def __init__(self) -> None:
        self.calls: list = []

    def pin_memory(self) -> _Recorder:
        self.calls.append("pin_memory")
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> _Recorder:
        self.calls.append(("to", device.type, non_blocking))
        return self


def test_stage_pins_only_for_a_gpu() -> None:
    """To a CUDA device through pinned memory, without blocking; elsewhere a plain copy."""
    t = _Recorder()
    stage(t, torch.device("cuda"))
    assert t.calls == ["pin_memory", ("to", "cuda", True)]
    t = _Recorder()
    stage(t, torch.device("cpu"))
    assert t.calls == [("to", "cpu", True)]


def _mixed_batch() -> StepBatch:
    """Three decodes, then two prompt chunks (one of them long), blocks of 16 tokens."""
    rng = random.Random(0)
    seqs = [([rng.randrange(3, 1000)], n, list(range(i * 64, i * 64 + -(-(n + 1) // 16))))
            for i, n in enumerate((40, 700, 5))]  # fmt: skip
    seqs += [([rng.randrange(3, 1000) for _ in range(n)], 0, list(range(j, j + -(-n // 16))))
             for j, n in ((400, 3000), (700, 33))]  # fmt: skip
    toks, starts, tables = (list(c) for c in zip(*seqs))
    return StepBatch(toks, starts, tables, [0, 1, 2, 3, 4])


@pytest.mark.gpu
def test_mixed_inputs_do_not_wait_for_the_device() -> None:
    """`build_inputs` on a GPU with a one-second kernel queued returns while that kernel still
    runs (asynchronous scheduling prepares a pass while the one before runs: a copy from
    pageable memory could hold the host until it ends), with the inputs it builds on the
    CPU."""
    cuda = torch.device("cuda")
    batch = _mixed_batch()
    want, _ = build_inputs(batch, 16, torch.device("cpu"))
    build_inputs(batch, 16, cuda)  # warm: the caching host allocator's first blocks
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)  # about a second at the H200's clocks
    t0 = time.perf_counter()
    got, _ = build_inputs(batch, 16, cuda)
    host_s = time.perf_counter() - t0
    still_running = not stream.query()
    torch.cuda.synchronize()
    assert still_running, f"build_inputs waited for the queued kernel ({host_s:.3f} s)"
    for name in ("input_ids", "positions", "sample_rows"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    for name in ("slot_mapping", "block_tables", "seq_lens", "cu_query_lens",
                 "prefill_cu_query_lens"):  # fmt: skip
        assert torch.equal(getattr(got.meta, name).cpu(), getattr(want.meta, name)), name
    # a decode plan (what build_inputs stages for the decode rows where plans pay) likewise
    plan = pagedattn_kernels.plan_decode([40, 700, 5], num_kv_heads=8, head_dim=128,
                                         dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                         device=cuda)  # fmt: skip
    staged = stage(plan, cuda)
    assert staged.work.is_cuda and torch.equal(staged.work.cpu(), plan.work)
    assert torch.equal(staged.merges.cpu(), plan.merges) and staged.tile_n == plan.tile_n


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
