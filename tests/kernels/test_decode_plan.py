"""Decode work plans (``pagedattn_kernels.attention.plan``) and the planned decode launch.

- ``chunk_size`` and ``build_plan`` (Hypothesis, host only): the chunk bound its docstring
  defines (the least whole tiles holding a lane's average work, ``min_chunk`` and
  1/MAX_CHUNKS of the longest row); every row's context covered exactly once by whole-tile
  chunks, longest first, a padding row by one empty item, the partial rows of a split row
  contiguous and named by its one merge entry, within ``capacity``, and a padded plan
  holding the same items; ``plan_decode`` as ``build_plan`` for the launch's tile and lanes;
- ``paged_decode_attention(plan=...)`` against the float64 reference and the unplanned path:
  padding rows (zeros), split rows, GQA, fp32 / bf16 / fp16 queries, a padded head dim, blocks
  larger than the interpreter's tile, fp8 caches with scales, padded plans, plans of many
  chunks and plans in any item order; the output and the split scratch poisoned with NaN;
- bad plans and bad planner arguments: a clear ``ValueError`` and nothing written.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.attention.plan import (
    MAX_CHUNKS,
    MIN_CHUNK,
    DecodePlan,
    build_plan,
    capacity,
    chunk_size,
)
from pagedattn_kernels.testing import (
    TOLERANCE,
    poisoned_like,
    random_paged_batch,
    rejected_unchanged,
    rel_error,
)

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, pk.FP8_DTYPE
TILES = [16, 32, 64, 128]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _num_chunks(lens: list[int], chunk: int) -> int:
    """Items of a plan whose chunks hold at most ``chunk`` tokens (a padding row: one)."""
    return sum(_ceil(n, chunk) if n else 1 for n in lens)


def check_plan(
    plan: DecodePlan, lens: list[int], tile_n: int, chunk: int | None = None, ordered: bool = True
) -> int:
    """Everything ``DecodePlan`` and ``build_plan`` promise about a plan of rows ``lens``
    (``chunk``: the bound on every chunk's length, where known; ``ordered``: longest first).
    Returns the number of items."""
    work, merges = plan.work, plan.merges
    assert work.dtype == torch.int32 and work.dim() == 2 and work.shape[1] == 4
    assert merges.dtype == torch.int32 and merges.dim() == 2 and merges.shape[1] == 3
    assert work.is_contiguous() and merges.is_contiguous()
    assert plan.tile_n == tile_n
    work_rows, merge_rows = work.tolist(), merges.tolist()
    items = [tuple(w) for w in work_rows if w[0] != -1]
    k = len(items)
    assert work_rows[:k] == [list(w) for w in items], "padding items must come last"
    assert all(w == [-1, -1, -1, -1] for w in work_rows[k:]), "padding items are all -1"
    assert plan.num_items == k
    m = sum(1 for r in merge_rows if r[0] != -1)
    assert all(r[0] != -1 for r in merge_rows[:m]), "padding merges must come last"
    assert all(r == [-1, -1, -1] for r in merge_rows[m:]), "padding merges are all -1"

    lengths = [end - start for _, start, end, _ in items]
    if ordered:
        assert lengths == sorted(lengths, reverse=True), "items must be listed longest first"
    by_row: dict[int, list[tuple[int, int, int]]] = {}
    for row, start, end, partial in items:
        assert 0 <= row < len(lens), f"item of row {row}, batch of {len(lens)}"
        by_row.setdefault(row, []).append((start, end, partial))
    assert sorted(by_row) == list(range(len(lens))), "every row needs at least one item"
    by_merge: dict[int, tuple[int, int]] = {}
    for row, first, count in merge_rows[:m]:
        assert row not in by_merge, f"row {row} has two merge entries"
        by_merge[row] = (first, count)

    partials: list[int] = []
    for row, n in enumerate(lens):
        chunks = sorted(by_row[row])
        if n == 0:
            assert chunks == [(0, 0, -1)], f"padding row {row}: {chunks}"
            assert row not in by_merge
            continue
        assert chunks[0][0] == 0 and chunks[-1][1] == n, f"row {row} of {n}: {chunks}"
        for (_, end, _), (start, _, _) in itertools.pairwise(chunks):
            assert end == start, f"row {row}: chunks not contiguous: {chunks}"
        assert all(start < end and start % tile_n == 0 for start, end, _ in chunks), chunks
        assert len(chunks) <= MAX_CHUNKS
        if chunk is not None:
            assert all(end - start <= chunk for start, end, _ in chunks), (row, chunk, chunks)
        # every chunk but the last: the row's length shared evenly, in whole tiles
        assert len({end - start for start, end, _ in chunks[:-1]}) <= 1, chunks
        if len(chunks) == 1:
            assert chunks[0][2] == -1, f"row {row} of one chunk writes a partial"
            assert row not in by_merge, f"row {row} of one chunk has a merge entry"
            continue
        own = [p for _, _, p in chunks]
        assert row in by_merge, f"split row {row} has no merge entry"
        first, count = by_merge[row]
        assert count == len(chunks), (row, count, chunks)
        assert sorted(own) == list(range(first, first + count)), (row, first, count, own)
        partials += own
    assert len(set(partials)) == len(partials), "two chunks share a partial row"
    # the launch sizes the partial buffers by the plan's items
    assert all(0 <= p < work.shape[0] for p in partials)
    assert len(by_merge) == sum(1 for r in by_row.values() if len(r) > 1)
    return k


# --------------------------------------------------------------------------- planning (host)

# Padding rows, short and long contexts, and rows of exact tile multiples.
ROW = st.one_of(
    st.just(0), st.integers(1, 64), st.integers(1, 2048), st.sampled_from([128, 1024, 2048])
)  # fmt: skip
# A few rows (long ones cut into many chunks), or batch sizes spread over 1..300 (a plain
# st.lists stays near a handful of rows).
LENS = st.one_of(
    st.lists(ROW, min_size=1, max_size=12),
    st.integers(1, 300).flatmap(lambda n: st.lists(ROW, min_size=n, max_size=n)),
)
LANES = st.one_of(st.integers(1, 200), st.sampled_from([1, 8, 132, 200]))
MIN_CHUNKS = st.sampled_from([MIN_CHUNK, MIN_CHUNK, 1, 48, 512])


@settings(max_examples=250, deadline=None)
@given(lens=LENS, lanes=LANES, tile_n=st.sampled_from(TILES), min_chunk=MIN_CHUNKS)
def test_chunk_size_is_the_least_whole_tiles_bound(lens, lanes, tile_n, min_chunk):
    """Whole tiles; at least the average work of a lane (so at most ``len(lens) + lanes``
    chunks), ``min_chunk`` and 1/MAX_CHUNKS of the longest row, but never past the longest row
    (in whole tiles); the least such multiple of ``tile_n``."""
    chunk = chunk_size(lens, lanes, tile_n, min_chunk)
    assert chunk % tile_n == 0 and chunk >= tile_n
    longest = max(lens)
    top = max(_ceil(longest, tile_n) * tile_n, tile_n)
    least = max(_ceil(sum(lens), lanes), min_chunk, _ceil(longest, MAX_CHUNKS), 1)
    assert chunk == top or chunk >= least, (chunk, least, top)
    assert chunk <= top and (chunk == tile_n or chunk - tile_n < least), (chunk, least, top)
    assert _ceil(longest, chunk) <= MAX_CHUNKS
    assert _num_chunks(lens, chunk) <= len(lens) + lanes
    if len(lens) <= lanes:
        assert _num_chunks(lens, chunk) <= 2 * lanes, "rows that fit one wave: chunks two"


@settings(max_examples=250, deadline=None)
@given(lens=LENS, lanes=LANES, tile_n=st.sampled_from(TILES), min_chunk=MIN_CHUNKS)
def test_build_plan_covers_every_row_once(lens, lanes, tile_n, min_chunk):
    chunk = chunk_size(lens, lanes, tile_n, min_chunk)
    plan = build_plan(lens, lanes, tile_n, min_chunk=min_chunk)
    k = check_plan(plan, lens, tile_n, chunk)
    assert k == plan.work.shape[0] == _num_chunks(lens, chunk), "unpadded: exactly the items"
    most_items, most_merges = capacity(len(lens), lanes)
    assert k <= most_items
    assert plan.merges.shape[0] <= most_merges
    if len(lens) <= lanes:
        assert k <= 2 * lanes, "rows that fit one wave: the items fit two"
    # Padded to the capacity (a CUDA graph's buffers): the same items and merges, then -1.
    padded = build_plan(lens, lanes, tile_n, size=(most_items, most_merges), min_chunk=min_chunk)
    assert padded.work.shape == (most_items, 4) and padded.merges.shape == (most_merges, 3)
    assert check_plan(padded, lens, tile_n, chunk) == k
    assert torch.equal(padded.work[:k], plan.work)
    assert torch.equal(padded.merges[: plan.merges.shape[0]], plan.merges)
    # Lengths given as a tensor (int32, as a scheduler holds them): the same plan.
    same = build_plan(torch.tensor(lens, dtype=torch.int32), lanes, tile_n, min_chunk=min_chunk)
    assert torch.equal(same.work, plan.work) and torch.equal(same.merges, plan.merges)


def test_build_plan_examples():
    """Hand-checked plans: long rows split evenly in whole tiles, longest first (stable), the
    partial rows numbered in row order; padding rows' empty items; a plan too big for a
    given size; negative lengths."""
    plan = build_plan([600, 0, 17, 130, 1, 0, 64], lanes=8, tile_n=64)
    # 812 tokens over 8 lanes: 102, raised to min_chunk (128): 600 in 5 chunks, 130 in 2
    assert plan.work.tolist() == [
        [0, 0, 128, 0], [0, 128, 256, 1], [0, 256, 384, 2], [0, 384, 512, 3], [3, 0, 128, 5],
        [0, 512, 600, 4], [6, 0, 64, -1], [2, 0, 17, -1], [3, 128, 130, 6], [4, 0, 1, -1],
        [1, 0, 0, -1], [5, 0, 0, -1],
    ]  # fmt: skip
    assert plan.merges.tolist() == [[0, 0, 5], [3, 5, 2]]
    # More rows than lanes: the average work of a lane (1000 / 2 -> 512 in tiles of 128).
    plan = build_plan([900, 100, 0], lanes=2, tile_n=128)
    assert plan.work.tolist() == [[0, 0, 512, 0], [0, 512, 900, 1], [1, 0, 100, -1],
                                  [2, 0, 0, -1]]  # fmt: skip
    assert plan.merges.tolist() == [[0, 0, 2]]
    # One row, many lanes, no min_chunk: 1/MAX_CHUNKS of the row bounds its chunks.
    plan = build_plan([4096], lanes=200, tile_n=16, min_chunk=1)
    assert plan.work.shape[0] == MAX_CHUNKS and plan.merges.tolist() == [[0, 0, MAX_CHUNKS]]
    with pytest.raises(ValueError, match="do not fit a capacity of 2"):
        build_plan([600, 600, 600], lanes=8, tile_n=64, size=(2, 1))
    with pytest.raises(ValueError, match=">= 0"):
        build_plan([5, -1], lanes=8, tile_n=64)


def test_plan_decode_is_build_plan_for_the_launch():
    """``plan_decode`` plans for the decode kernel's tile and lanes (on the CPU: the
    interpreter's 64-token tiles, 2 programs on each of 4 SMs, shared by the KV heads);
    ``padded`` sizes it to ``decode_plan_capacity``; host lengths as a list or a tensor."""
    from pagedattn_kernels.attention import triton_launch

    lens = [600, 0, 17, 130, 1, 0, 64, 257]
    for num_kv_heads in (1, 2, 3, 8):
        kw = {"num_kv_heads": num_kv_heads, "head_dim": 32, "dtype": BF16, "kv_dtype": BF16,
              "device": "cpu"}  # fmt: skip
        cfg, lanes = triton_launch.decode_lanes(len(lens), num_kv_heads, 32, BF16, BF16,
                                                torch.device("cpu"))  # fmt: skip
        assert lanes == max(1, 8 // num_kv_heads)
        plan = pk.plan_decode(lens, **kw)
        want = build_plan(lens, lanes, cfg.tile_n)
        assert plan.tile_n == cfg.tile_n == 64
        assert torch.equal(plan.work, want.work) and torch.equal(plan.merges, want.merges)
        size = pk.decode_plan_capacity(len(lens), **kw)
        assert size == capacity(len(lens), lanes)
        padded = pk.plan_decode(torch.tensor(lens), padded=True, **kw)
        assert (padded.work.shape[0], padded.merges.shape[0]) == size
        assert check_plan(padded, lens, 64) == plan.work.shape[0]
        small = pk.plan_decode(lens, min_chunk=1, **kw)
        check_plan(small, lens, 64, chunk_size(lens, lanes, 64, 1))


# --------------------------------------------------------------------------- planned decode


@pytest.fixture
def poisoned_scratch(target, monkeypatch):
    """The Triton launchers' split scratch (partial outputs and log-sum-exps) filled with NaN,
    so that a merge reading a partial row no chunk wrote shows."""
    if target.backend == "triton":
        from pagedattn_kernels.attention import triton_launch

        real = triton_launch._scratch
        monkeypatch.setattr(triton_launch, "_scratch",
                            lambda n, device: real(n, device).fill_(float("nan")))  # fmt: skip


def _plan(target, lens, num_kv_heads, head_dim, dtype, kv_dtype, **kw) -> DecodePlan:
    plan = pk.plan_decode(lens, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                          kv_dtype=kv_dtype, device=target.device, **kw)  # fmt: skip
    check_plan(plan, lens, plan.tile_n)
    return plan.to(torch.device(target.device))


def _lens(target, gen) -> list[int]:
    """Padding rows, contexts of one token, of a tile, ragged ones, and long ones that the
    plan splits (on the CPU: 600 and 257 tokens over 8 lanes)."""
    if not target.full:
        return [600, 0, 17, 130, 1, 0, 64, 257]
    lens = [20000, 0, 3, 9000, 1, 4099, 0, 700, 128]
    return lens + torch.randint(1, 3000, (16,), generator=gen, device=gen.device).tolist()


def _run_plans(target, seed, batch, dtype, kv_dtype, scales):
    """The batch decoded without a plan, with its plan and with its padded plan: each matches
    the float64 reference, the padded plan's output is the plan's bit for bit (same chunks),
    padding rows get zeros; the torch backend ignores plans (on the CPU: bit-identical; on
    CUDA two runs of its fp8 path can differ in the last bit, plan or not)."""
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    num_kv_heads, head_dim = batch.key_cache.shape[2], batch.query.shape[2]
    ref = reference.paged_decode_attention(*args, **scales)
    plain = pk.paged_decode_attention(*args, out=poisoned_like(batch.query),
                                      backend=target.backend, **scales)  # fmt: skip
    err = rel_error(plain, ref)
    assert err < TOLERANCE[dtype], f"no plan: rel error {err:.2e} (seed={seed})"
    outs = []
    for padded in (False, True):
        plan = _plan(target, batch.lens, num_kv_heads, head_dim, dtype, kv_dtype, padded=padded)
        if not padded and target.backend == "triton" and not target.full:
            assert plan.merges.shape[0] > 0, "the CPU shapes must split a row"
        out = pk.paged_decode_attention(*args, out=poisoned_like(batch.query),
                                        backend=target.backend, plan=plan, **scales)  # fmt: skip
        err = rel_error(out, ref)
        assert err < TOLERANCE[dtype], f"padded={padded}: rel error {err:.2e} (seed={seed})"
        err = rel_error(out, plain.double())
        assert err < TOLERANCE[dtype], f"padded={padded} vs no plan: {err:.2e} (seed={seed})"
        for row, n in enumerate(batch.lens):
            if n == 0:
                assert bool((out[row] == 0).all()), f"padding row {row} must be zeros"
        if target.backend == "torch" and not target.full:  # (torch on CUDA: not bitwise)
            assert torch.equal(out, plain), "the torch backend ignores plans"
        outs.append(out)
    if target.backend == "triton" or not target.full:
        assert torch.equal(outs[0], outs[1]), f"padded plan differs from the plan (seed={seed})"


# (head_dim, query and cache dtype, block_size, queries per KV head, KV heads)
PLAN_CASES = [
    (32, F32, 16, 4, 1),
    (64, BF16, 8, 3, 2),  # GQA, 4 lanes per KV head on the CPU
    (80, F16, 32, 1, 1),  # padded head dim: the merge masks it
    (32, F32, 128, 2, 1),  # blocks larger than the interpreter's 64-token tile
]


def _case_id(case) -> str:
    head_dim, dtype, block_size, group, kv = case
    return f"d{head_dim}-{str(dtype).removeprefix('torch.')}-bs{block_size}-g{group}-kv{kv}"


@pytest.mark.parametrize("case", PLAN_CASES, ids=_case_id)
def test_planned_decode_matches_reference(target, seed, case, poisoned_scratch):
    head_dim, dtype, block_size, group, num_kv_heads = case
    gen = target.generator(seed)
    if target.full:
        num_kv_heads *= 2
    lens = _lens(target, gen)
    batch = random_paged_batch(
        gen, lens, [1] * len(lens), num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=target.device,
    )  # fmt: skip
    _run_plans(target, seed, batch, dtype, dtype, {})


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_planned_decode_reads_fp8(target, seed, dtype, poisoned_scratch):
    """An fp8 cache (values about 4, scales 0.25 and 0.5, as ``test_fp8``): the partial
    outputs the merge combines carry v_scale. On a GPU also a batch of 64 rows x 8 KV heads,
    which takes the narrow fp8 tiles (the plan follows the launch's tile)."""
    gen = target.generator(seed)
    shapes = [(_lens(target, gen), 1 if not target.full else 4)]
    if target.full:
        shapes.append((torch.randint(0, 2000, (64,), generator=gen, device=gen.device).tolist(), 8))
    scales = {"k_scale": torch.tensor([0.25], device=target.device),
              "v_scale": torch.tensor([0.5], device=target.device)}  # fmt: skip
    for lens, num_kv_heads in shapes:
        batch = random_paged_batch(
            gen, lens, [1] * len(lens), num_heads=4 * num_kv_heads, num_kv_heads=num_kv_heads,
            head_dim=64, block_size=16, dtype=dtype, device=target.device,
        )  # fmt: skip
        batch.key_cache = (4 * batch.key_cache.float()).to(FP8)
        batch.value_cache = (4 * batch.value_cache.float()).to(FP8)
        _run_plans(target, seed, batch, dtype, FP8, scales)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_planned_decode_follows_any_valid_plan(target, seed, group, poisoned_scratch):
    """The launch runs whatever valid plan it gets: one of a row cut into MAX_CHUNKS chunks of
    one tile (built for more lanes than the device has: the merge takes several passes over
    the partial rows when the group is wide), and the same plan with its items shuffled, in
    buffers larger than they need: bit-identical (each chunk is computed alone and merged by
    its partial row), written into a strided output view and nowhere else."""
    if target.backend != "triton":
        pytest.skip("plans schedule the Triton kernels")
    gen = target.generator(seed)
    head_dim = 32
    tile_n = pk.plan_decode([1], num_kv_heads=1, head_dim=head_dim, dtype=F32, kv_dtype=F32,
                            device=target.device).tile_n  # fmt: skip
    lens = [MAX_CHUNKS * tile_n, 0, 5, 3 * tile_n + 1]
    batch = random_paged_batch(
        gen, lens, [1] * len(lens), num_heads=group, num_kv_heads=1, head_dim=head_dim,
        block_size=16, dtype=F32, device=target.device,
    )  # fmt: skip
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(*args)
    plan = build_plan(lens, lanes=1000, tile_n=tile_n, min_chunk=1)
    check_plan(plan, lens, tile_n)
    assert plan.merges.tolist() == [[0, 0, MAX_CHUNKS], [3, MAX_CHUNKS, 4]]
    k = plan.work.shape[0]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    roomy = build_plan(lens, lanes=1000, tile_n=tile_n, min_chunk=1, size=(k + 50, 9))
    roomy.work[:k] = plan.work[perm]
    check_plan(roomy, lens, tile_n, ordered=False)
    # the second run writes into a strided view of a wider buffer (heads sliced out of it)
    wide = poisoned_like(torch.cat([batch.query] * 3, dim=1))
    outs = []
    for p, dst in ((plan, poisoned_like(batch.query)), (roomy, wide[:, group : 2 * group])):
        out = pk.paged_decode_attention(*args, out=dst, backend="triton",
                                        plan=p.to(torch.device(target.device)))  # fmt: skip
        assert out.data_ptr() == dst.data_ptr()
        err = rel_error(out, ref)
        assert err < TOLERANCE[F32], f"rel error {err:.2e} (seed={seed})"
        assert bool((out[1] == 0).all()), "a padding row must give zeros"
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), f"item order / buffer size changed the output ({seed=})"
    assert bool(wide[:, :group].isnan().all() and wide[:, 2 * group :].isnan().all()), (
        "wrote outside the output view"
    )


# --------------------------------------------------------------------------- bad calls


def test_decode_rejects_bad_plans():
    """A plan's tensors of the wrong dtype, width, rank or device, non-contiguous, not a
    DecodePlan, or beside num_splits / seq_order: rejected on either backend; a plan in other
    tiles than the kernel's: rejected by the Triton launch (ignored by the torch path)."""
    gen = torch.Generator().manual_seed(2)
    lens = [300, 0, 40]
    b = random_paged_batch(gen, lens, [1] * 3, num_heads=4, num_kv_heads=2, head_dim=32,
                           block_size=16, dtype=F32)  # fmt: skip
    args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens)
    good = pk.plan_decode(lens, num_kv_heads=2, head_dim=32, dtype=F32, kv_dtype=F32,
                          device="cpu")  # fmt: skip
    work, merges = good.work, good.merges
    assert work.shape[0] > 1 and merges.shape[0] == 1, "the bad plans below need a split row"
    elsewhere = torch.device("cuda" if torch.cuda.is_available() else "meta")
    out = torch.full_like(b.query, 7.0)

    def call(plan, backend="triton", **kw):
        return lambda: pk.paged_decode_attention(*args, out=out, backend=backend, plan=plan, **kw)

    wide = torch.zeros(work.shape[0], 8, dtype=torch.int32)
    wide[:, :4] = work
    bad = [
        (DecodePlan(work.long(), merges, 64), "plan.work must be int32 [rows, 4], got torch.int64"),
        (DecodePlan(work, merges.long(), 64), "plan.merges must be int32 [rows, 3]"),
        (DecodePlan(work[:, :3].contiguous(), merges, 64), "plan.work must be int32 [rows, 4]"),
        (DecodePlan(wide, merges, 64), "plan.work must be int32 [rows, 4]"),
        (DecodePlan(work.reshape(-1), merges, 64), "plan.work must be int32 [rows, 4]"),
        (DecodePlan(work, merges[:, :2].contiguous(), 64), "plan.merges must be int32 [rows, 3]"),
        (DecodePlan(work.to(elsewhere), merges, 64), "plan.work must be on cpu (the query"),
        (DecodePlan(work, merges.to(elsewhere), 64), "plan.merges must be on cpu (the query"),
        (DecodePlan(wide[:, :4], merges, 64), "plan.work must be contiguous"),
        (DecodePlan(work.t().contiguous().t(), merges, 64), "plan.work must be contiguous"),
        ((work, merges, 64), "plan must be a DecodePlan, got tuple"),
    ]
    for backend in ("triton", "torch"):  # checked before the backend is chosen
        for plan, match in bad:
            assert match in rejected_unchanged(call(plan, backend), out), (backend, match)
        order = torch.arange(3, dtype=torch.int32)
        for kw in ({"num_splits": 2}, {"num_splits": 1}, {"seq_order": order}):
            msg = rejected_unchanged(call(good, backend, **kw), out)
            assert "pass neither num_splits nor seq_order" in msg, msg
    # A plan in other tiles than the kernel's (built for another dtype or device, say).
    for tile_n in (32, 128):
        other = build_plan(lens, lanes=4, tile_n=tile_n)
        msg = rejected_unchanged(call(other), out)
        assert f"in tiles of {tile_n} tokens, the kernel's tiles 64" in msg, msg
        # the torch path has no tiles: it ignores the plan
        torch.testing.assert_close(call(other, "torch")(), call(good, "torch")())


def test_plan_decode_rejects():
    """Negative context lengths (list or tensor), a min_chunk that is not a positive int, no
    KV heads or no head dim: a ValueError naming plan_decode."""
    kw = {"num_kv_heads": 2, "head_dim": 64, "dtype": BF16, "kv_dtype": BF16, "device": "cpu"}
    for lens in ([5, -1, 3], torch.tensor([5, -1], dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"^plan_decode: context lengths must be >= 0"):
            pk.plan_decode(lens, **kw)
    for min_chunk in (0, -128, 1.5, "128", True):
        with pytest.raises(ValueError, match=r"^plan_decode: min_chunk must be a positive int"):
            pk.plan_decode([5, 300], **{**kw, "min_chunk": min_chunk})
    for bad in ({"num_kv_heads": 0}, {"num_kv_heads": -2}, {"head_dim": 0}):
        with pytest.raises(ValueError, match=r"^plan_decode: num_kv_heads and head_dim must be"):
            pk.plan_decode([5, 300], **{**kw, **bad})
        with pytest.raises(ValueError, match=r"^decode_plan_capacity: num_kv_heads and head_d"):
            pk.decode_plan_capacity(4, **{**kw, **bad})
