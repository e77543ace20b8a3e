"""The buddy allocator of the Orca baselines against a slot-by-slot model: chunks are powers of
two aligned to their size, never overlap and stay inside the capacity; freeing everything
merges back to the initial roots; a refusal happens exactly when no free chunk is big enough
(external fragmentation); bad calls raise and change nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.bench.buddy import BuddyAllocator


def _free_chunks(b: BuddyAllocator) -> list[tuple[int, int]]:
    return sorted((start, 1 << order) for order, starts in enumerate(b._free) for start in starts)


def test_roots_cover_a_capacity_that_is_not_a_power_of_two():
    b = BuddyAllocator(15728, 2048)  # OPT-13B's 12 GiB of KV: 7 x 2048 + 1024 + 256 + 64 + 32 + 16
    assert _free_chunks(b) == [(i * 2048, 2048) for i in range(7)] + [
        (14336, 1024), (15360, 256), (15616, 64), (15680, 32), (15712, 16)]  # fmt: skip
    assert b.num_free == 15728 and b.largest_chunk == 2048 and b.largest_free_chunk() == 2048
    starts = [b.allocate(2048) for _ in range(7)]
    assert starts == [i * 2048 for i in range(7)]
    assert b.allocate(2048) is None  # 1392 slots free, no 2048 chunk: the eighth max request waits
    assert b.num_free == 1392


def test_external_fragmentation_refuses_although_enough_slots_are_free():
    b = BuddyAllocator(64, 64)
    a, c, d = b.allocate(16), b.allocate(16), b.allocate(16)
    assert (a, c, d) == (0, 16, 32)
    b.free(a)
    assert b.num_free == 32 and not b.can_allocate(32) and b.allocate(32) is None
    b.free(c)  # 0..31 merges back into one chunk
    assert b.allocate(32) == 0
    assert b.chunk_size(17) == 32 and b.chunk_size(1) == 1 and b.chunk_size(2048) == 2048


def test_bad_calls_raise_and_change_nothing():
    for cap, top in ((0, 16), (10, 12), (True, 16), (10, 0)):
        with pytest.raises(ValueError):
            BuddyAllocator(cap, top)
    b = BuddyAllocator(100, 64)
    first = b.allocate(10)
    before = (_free_chunks(b), b.num_free, dict(b._allocated))
    for bad in (0, -1, 65, True, 2.0):
        with pytest.raises(ValueError):
            b.allocate(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not the start"):
        b.free(first + 1)
    b.free(first)
    with pytest.raises(ValueError, match="not the start"):
        b.free(first)  # twice
    b2 = BuddyAllocator(100, 64)
    b2.allocate(10)
    b2.free(first)
    assert (_free_chunks(b2), b2.num_free) == (_free_chunks(b), b.num_free)
    assert before[1] == 100 - 16


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(1, 600),
    top_order=st.integers(0, 8),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 256), st.integers(0, 10**6)), max_size=60),
)
def test_matches_a_slot_model(capacity, top_order, ops):
    top = 1 << top_order
    b = BuddyAllocator(capacity, top)
    initial = _free_chunks(b)
    used = [False] * capacity
    live: dict[int, int] = {}
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            if size > b.largest_chunk:
                with pytest.raises(ValueError):
                    b.allocate(size)
                continue
            chunk = b.chunk_size(size)
            fits = any(n >= chunk for _, n in _free_chunks(b))
            start = b.allocate(size)
            assert (start is not None) == fits
            if start is None:
                continue
            assert start % chunk == 0 and start + chunk <= capacity
            assert not any(used[start : start + chunk]), "overlapping chunks"
            used[start : start + chunk] = [True] * chunk
            live[start] = chunk
        else:
            start = sorted(live)[pick % len(live)]
            b.free(start)
            chunk = live.pop(start)
            used[start : start + chunk] = [False] * chunk
        assert b.num_free == capacity - sum(live.values()) == used.count(False)
        for s, n in _free_chunks(b):  # free chunks hold exactly the free slots
            assert not any(used[s : s + n])
        assert sum(n for _, n in _free_chunks(b)) == b.num_free
    for start in list(live):
        b.free(start)
    assert _free_chunks(b) == initial
