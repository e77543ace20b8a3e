"""BlockPool: O(1) free queue order, ref counts, cached-block placement and eviction hook."""

from __future__ import annotations

import pytest

from kvblocks import BlockPool, DoubleFreeError, InvalidBlockError, NoFreeBlocksError


def pool_state(p: BlockPool) -> tuple:
    return (
        p.num_free,
        p.num_used,
        tuple(p.ref_count(b) for b in range(p.num_blocks)),
        tuple(p.free_block_ids()),
    )


def test_allocates_in_id_order_and_counts() -> None:
    p = BlockPool(4)
    assert (p.num_blocks, p.device) == (4, "gpu")
    assert p.free_block_ids() == [0, 1, 2, 3]
    assert [p.allocate(), p.allocate()] == [0, 1]
    assert (p.num_free, p.num_used) == (2, 2)
    assert p.allocate_n(2) == [2, 3]
    assert p.num_free == 0 and p.free_block_ids() == []


def test_freed_uncached_blocks_are_reused_first_lifo() -> None:
    p = BlockPool(5, device="cpu")
    assert p.allocate_n(4) == [0, 1, 2, 3]
    p.decref(1)
    p.decref(3)
    assert p.free_block_ids() == [3, 1, 4]
    assert p.allocate() == 3


def test_ref_counts_share_and_release() -> None:
    p = BlockPool(3)
    b = p.allocate()
    p.incref(b)
    p.incref(b)
    assert p.ref_count(b) == 3
    p.decref(b)
    p.decref(b)
    assert p.ref_count(b) == 1 and not p.is_free(b)
    p.decref(b)
    assert p.ref_count(b) == 0 and p.is_free(b)
    assert p.free_block_ids() == [0, 1, 2]


def test_cached_blocks_go_to_tail_and_touch_unlinks_from_middle() -> None:
    p = BlockPool(6)
    evicted: list[int] = []
    p.on_evict = evicted.append
    assert p.allocate_n(4) == [0, 1, 2, 3]
    for b in (0, 1, 2):
        p.set_cached(b, True)
    # Release 2, 1, 0 (a sequence's blocks, tail first) and the uncached 3.
    for b in (2, 1, 0, 3):
        p.decref(b)
    assert p.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert p.num_free == 6
    # A prefix hit on block 1 takes it out of the middle of the queue.
    p.touch(1)
    assert p.free_block_ids() == [3, 4, 5, 2, 0]
    assert p.ref_count(1) == 1 and p.num_free == 5
    # Uncached blocks are handed out before any cached one; then least recently freed first.
    assert p.allocate_n(3) == [3, 4, 5]
    assert evicted == []
    assert p.allocate() == 2
    assert evicted == [2]
    assert not p.is_cached(2) and p.is_cached(0)


def test_empty_pool() -> None:
    p = BlockPool(0)
    assert p.num_free == 0 and p.free_block_ids() == []
    with pytest.raises(NoFreeBlocksError, match="no free gpu block"):
        p.allocate()
    assert p.allocate_n(0) == []


@pytest.mark.parametrize(
    ("op", "exc", "msg"),
    [
        (lambda p: p.decref(2), DoubleFreeError, "already free"),
        (lambda p: p.incref(2), InvalidBlockError, "is free"),
        (lambda p: p.decref(9), InvalidBlockError, "out of range"),
        (lambda p: p.ref_count(-1), InvalidBlockError, "out of range"),
        (lambda p: p.touch("1"), InvalidBlockError, "ints"),
        (lambda p: p.allocate_n(2), NoFreeBlocksError, "2 gpu blocks needed but only 1"),
        (lambda p: p.allocate_n(-1), ValueError, "n >= 0"),
    ],
)
def test_misuse_raises_and_changes_nothing(op, exc, msg) -> None:
    p = BlockPool(3)
    p.allocate_n(2)
    p.decref(0)
    p.allocate()
    p.incref(0)
    before = pool_state(p)
    with pytest.raises(exc, match=msg):
        op(p)
    assert pool_state(p) == before


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-1)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(True)
    # A pool counts blocks only; the block size belongs to the BlockManager (checked once there).
    with pytest.raises(TypeError):
        BlockPool(4, 16)  # type: ignore[misc]
