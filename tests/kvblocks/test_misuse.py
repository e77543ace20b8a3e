"""Every misuse raises a specific exception with a helpful message and changes no state.

Each case builds the same busy manager (shared blocks, a swapped-out sequence, cached blocks,
counters), snapshots all state, makes the bad call and compares the snapshot afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvblocks import (
    BlockLimitError,
    BlockManager,
    KVBlocksError,
    NoFreeBlocksError,
    SequenceExistsError,
    SwapError,
    SwapSpaceError,
    UnknownSequenceError,
)


def busy() -> BlockManager:
    m = BlockManager(
        block_size=4,
        num_gpu_blocks=8,
        num_cpu_blocks=3,
        enable_prefix_caching=True,
        max_blocks_per_seq=4,
    )
    m.allocate(0, range(6))
    m.grow(0, 6)  # [0, 1], block 0 cached
    m.fork(0, 1)  # shares [0, 1]
    m.allocate(2, range(6))  # prefix hit on block 0
    m.grow(2, 2)  # [0, 2]
    m.allocate(3, [5, 5, 5])
    m.grow(3, 3)
    m.swap_out([3])  # seq 3 on the CPU
    m.allocate(4, range(40, 49))  # 9 tokens, no slots yet (waiting)
    m.allocate(5, range(100, 112))
    m.grow(5, 12)  # 3 blocks: only 2 GPU blocks are left free
    assert m.gpu_pool.num_free == 2
    return m


def _case(fn: Callable[[BlockManager], object], exc: type[Exception], msg: str):
    return pytest.param(fn, exc, msg, id=msg)


CASES = [
    _case(lambda m: m.allocate(0, [1]), SequenceExistsError, "already exists"),
    _case(lambda m: m.allocate(9, []), ValueError, "token_ids is empty"),
    _case(lambda m: m.allocate(9, range(17)), BlockLimitError, "at most 16 fit"),
    _case(lambda m: m.allocate(9, [1], extra_key=[1]), ValueError, "extra_key must be hashable"),
    _case(lambda m: m.peek_prefix([]), ValueError, "token_ids is empty"),
    _case(lambda m: m.free(9), UnknownSequenceError, "unknown sequence 9"),
    _case(lambda m: m.append_token_ids(9, [1]), UnknownSequenceError, "unknown sequence"),
    _case(lambda m: m.append_token_ids(0, 5), TypeError, "not iterable"),
    _case(lambda m: m.grow(9, 1), UnknownSequenceError, "call allocate"),
    _case(lambda m: m.grow(0, 1), ValueError, "append_token_ids() first"),
    _case(lambda m: m.grow(0, -1), ValueError, "num_new_slots must be an int"),
    _case(lambda m: m.grow(0, 1.0), ValueError, "num_new_slots must be an int"),
    _case(lambda m: m.grow(4, 9), NoFreeBlocksError, "needs 3 GPU blocks"),
    _case(lambda m: m.grow(3, 1), SwapError, "swapped out"),
    _case(lambda m: m.blocks_needed(3, 1), SwapError, "swapped out"),
    _case(lambda m: m.can_grow(0, -2), ValueError, "num_new_slots"),
    _case(lambda m: m.fork(9, 10), UnknownSequenceError, "unknown sequence 9"),
    _case(lambda m: m.fork(0, 2), SequenceExistsError, "already exists"),
    _case(lambda m: m.fork(0, 0), SequenceExistsError, "already exists"),
    _case(lambda m: m.swap_out([]), SwapError, "empty"),
    _case(lambda m: m.swap_out([0, 0]), SwapError, "twice"),
    _case(lambda m: m.swap_out([0, 3]), SwapError, "already on the CPU"),
    _case(lambda m: m.swap_out([0, 9]), UnknownSequenceError, "unknown sequence 9"),
    _case(lambda m: m.swap_out([0, 1, 2, 4]), SwapSpaceError, "3 distinct blocks but the cpu"),
    _case(lambda m: m.swap_in([0]), SwapError, "already on the GPU"),
    _case(lambda m: m.can_swap_in([9]), UnknownSequenceError, "unknown"),
    _case(lambda m: m.slot(0, 6), ValueError, "no reserved slot"),
    _case(lambda m: m.slot(4, 0), ValueError, "grow() first"),
    _case(lambda m: m.slots(0, 2, 7), ValueError, "not within the reserved"),
    _case(lambda m: m.slots(0, 3, 2), ValueError, "not within the reserved"),
    _case(lambda m: m.block_table(9), UnknownSequenceError, "unknown"),
    _case(lambda m: m.location(9), UnknownSequenceError, "unknown"),
]


@pytest.mark.parametrize(("fn", "exc", "msg"), CASES)
def test_misuse_raises_and_changes_nothing(fn, exc, msg) -> None:
    m = busy()
    m.check_invariants()
    before = m.debug_snapshot()
    stats_before = m.stats()
    with pytest.raises(exc) as info:
        fn(m)
    assert msg in str(info.value)
    assert m.debug_snapshot() == before
    assert m.stats() == stats_before
    m.check_invariants()


def test_grow_past_block_limit_and_cow_without_memory() -> None:
    m = busy()
    m.append_token_ids(1, range(11))  # 17 tokens
    before = m.debug_snapshot()
    with pytest.raises(BlockLimitError, match="max_blocks_per_seq=4"):
        m.grow(1, 11)
    assert m.debug_snapshot() == before
    # seq 1 shares the partly filled block 1 with seq 0: growing by 1 needs a copy.
    m.allocate(6, range(200, 208))
    m.grow(6, 8)
    assert m.gpu_pool.num_free == 0
    assert m.blocks_needed(1, 1) == 1 and not m.can_grow(1, 1)
    before = m.debug_snapshot()
    with pytest.raises(NoFreeBlocksError, match="needs 1 GPU blocks to grow by 1"):
        m.grow(1, 1)
    assert m.debug_snapshot() == before


def test_errors_form_one_hierarchy() -> None:
    for cls in (
        BlockLimitError,
        NoFreeBlocksError,
        SequenceExistsError,
        SwapError,
        SwapSpaceError,
        UnknownSequenceError,
    ):
        assert issubclass(cls, KVBlocksError)
    assert issubclass(UnknownSequenceError, KeyError)
    assert issubclass(SwapSpaceError, NoFreeBlocksError)
    # KeyError would quote the message; ours reads plainly.
    assert str(UnknownSequenceError("unknown sequence 3")) == "unknown sequence 3"


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"block_size": 12, "num_gpu_blocks": 4}, "power of two"),
        ({"block_size": 0, "num_gpu_blocks": 4}, "power of two"),
        ({"num_gpu_blocks": -1}, "num_blocks"),
        ({"num_gpu_blocks": 4, "num_cpu_blocks": -1}, "num_blocks"),
        ({"num_gpu_blocks": 4, "max_blocks_per_seq": 0}, "max_blocks_per_seq"),
        ({"num_gpu_blocks": 4, "hash_fn": 3}, "hash_fn must be callable"),
    ],
)
def test_bad_configuration(kwargs, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        BlockManager(**kwargs)
