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


def busy() -> tuple[BlockManager, dict[int, list[int]]]:
    """A manager with shared, cached, swapped-out and waiting sequences, and the token lists
    that the caller (the test) owns."""
    m = BlockManager(
        block_size=4,
        num_gpu_blocks=8,
        num_cpu_blocks=3,
        enable_prefix_caching=True,
        max_blocks_per_seq=4,
    )
    t = {0: list(range(6)), 2: list(range(6)), 3: [5, 5, 5], 4: list(range(40, 49))}
    t[5] = list(range(100, 112))
    m.allocate(0, t[0])
    m.allocate_slots(0, 6)  # [0, 1], block 0 cached
    t[1] = t[0].copy()
    m.fork(0, 1, t[1])  # shares [0, 1]
    m.allocate(2, t[2])  # prefix hit on block 0
    m.allocate_slots(2, 2)  # [0, 2]
    m.allocate(3, t[3])
    m.allocate_slots(3, 3)
    m.swap_out([3])  # seq 3 on the CPU
    m.allocate(4, t[4])  # 9 tokens, no slots yet (waiting)
    m.allocate(5, t[5])
    m.allocate_slots(5, 12)  # 3 blocks: only 2 GPU blocks are left free
    assert m.num_free_blocks == 2
    return m, t


Case = Callable[[BlockManager, dict[int, list[int]]], object]


def _case(fn: Case, exc: type[Exception], msg: str):
    return pytest.param(fn, exc, msg, id=msg)


CASES = [
    _case(lambda m, t: m.allocate(0, [1]), SequenceExistsError, "already exists"),
    _case(lambda m, t: m.allocate(9, []), ValueError, "token_ids is empty"),
    _case(lambda m, t: m.allocate(9, range(3)), ValueError, "must be a list that you own"),
    _case(lambda m, t: m.allocate(9, list(range(17))), BlockLimitError, "at most 16 fit"),
    _case(lambda m, t: m.allocate(9, [1], extra_key=[1]), ValueError, "extra_key must be hashable"),
    _case(lambda m, t: m.peek_prefix([]), ValueError, "token_ids is empty"),
    _case(lambda m, t: m.free(9), UnknownSequenceError, "unknown sequence 9"),
    _case(lambda m, t: m.allocate_slots(9, 1), UnknownSequenceError, "call allocate"),
    _case(lambda m, t: m.allocate_slots(0, 1), ValueError, "append the tokens"),
    _case(lambda m, t: m.allocate_slots(0, -1), ValueError, "num_new_tokens must be an int"),
    _case(lambda m, t: m.allocate_slots(0, 1.0), ValueError, "num_new_tokens must be an int"),
    _case(lambda m, t: m.allocate_slots(4, 1, 1), ValueError, "prefix caching cannot hash"),
    _case(lambda m, t: m.allocate_slots(3, 1), SwapError, "swapped out"),
    _case(lambda m, t: m.blocks_needed(3, 1), SwapError, "swapped out"),
    _case(lambda m, t: m.blocks_needed(0, -2), ValueError, "num_new_tokens"),
    _case(lambda m, t: m.group_blocks_needed([0, 3], [1, 1]), SwapError, "swapped out"),
    _case(lambda m, t: m.group_blocks_needed([0, 1], [1]), ValueError, "one per sequence"),
    _case(lambda m, t: m.group_blocks_needed([0, 0], [1, 1]), ValueError, "twice"),
    _case(lambda m, t: m.blocks_needed_to_swap_in([0], [1]), SwapError, "already on the GPU"),
    _case(lambda m, t: m.blocks_needed_to_swap_in([3], [-1]), ValueError, "num_new_tokens"),
    _case(lambda m, t: m.blocks_needed_to_admit([[]]), ValueError, "token_ids is empty"),
    _case(lambda m, t: m.blocks_needed_to_admit([[1, 2]], [3]), ValueError, "exceed"),
    _case(lambda m, t: m.fork(9, 10, []), UnknownSequenceError, "unknown sequence 9"),
    _case(lambda m, t: m.fork(0, 2, t[0].copy()), SequenceExistsError, "already exists"),
    _case(lambda m, t: m.fork(0, 0, t[0].copy()), SequenceExistsError, "already exists"),
    _case(lambda m, t: m.fork(0, 10, t[0]), ValueError, "own new list"),
    _case(lambda m, t: m.fork(0, 10, [9]), ValueError, "must equal the parent's"),
    _case(lambda m, t: m.swap_out([]), SwapError, "empty"),
    _case(lambda m, t: m.swap_out([0, 0]), SwapError, "twice"),
    _case(lambda m, t: m.swap_out([0, 3]), SwapError, "already on the CPU"),
    _case(lambda m, t: m.swap_out([0, 9]), UnknownSequenceError, "unknown sequence 9"),
    _case(lambda m, t: m.swap_out([0, 1, 2, 4]), SwapSpaceError, "3 distinct blocks but the cpu"),
    _case(lambda m, t: m.swap_in([0]), SwapError, "already on the GPU"),
    _case(lambda m, t: m.can_swap_in([9]), UnknownSequenceError, "unknown"),
    _case(lambda m, t: m.slot(0, 6), ValueError, "no reserved slot"),
    _case(lambda m, t: m.slot(4, 0), ValueError, "allocate_slots() first"),
    _case(lambda m, t: m.slots(0, 2, 7), ValueError, "not within the reserved"),
    _case(lambda m, t: m.slots(0, 3, 2), ValueError, "not within the reserved"),
    _case(lambda m, t: m.block_table(9), UnknownSequenceError, "unknown"),
    _case(lambda m, t: m.location(9), UnknownSequenceError, "unknown"),
]


@pytest.mark.parametrize(("fn", "exc", "msg"), CASES)
def test_misuse_raises_and_changes_nothing(fn, exc, msg) -> None:
    m, t = busy()
    m.check_invariants()
    before = m.debug_snapshot()
    stats_before = m.stats()
    with pytest.raises(exc) as info:
        fn(m, t)
    assert msg in str(info.value)
    assert m.debug_snapshot() == before
    assert m.stats() == stats_before
    m.check_invariants()


def test_no_free_blocks_is_an_answer_not_an_error_and_changes_nothing() -> None:
    m, _ = busy()
    assert m.blocks_needed(4, 9) == 3 and m.num_free_blocks == 2
    before = m.debug_snapshot()
    assert m.allocate_slots(4, 9) is None
    assert m.debug_snapshot() == before
    assert m.allocate_slots(4, 8) == ()  # two blocks do fit
    m.check_invariants()


def test_grow_past_block_limit_and_cow_without_memory() -> None:
    m, t = busy()
    t[1].extend(range(11))  # 17 tokens
    before = m.debug_snapshot()
    with pytest.raises(BlockLimitError, match="max_blocks_per_seq=4"):
        m.allocate_slots(1, 11)
    assert m.debug_snapshot() == before
    # seq 1 shares the partly filled block 1 with seq 0: growing by 1 needs a copy.
    t[6] = list(range(200, 208))
    m.allocate(6, t[6])
    m.allocate_slots(6, 8)
    assert m.num_free_blocks == 0
    assert m.blocks_needed(1, 1) == 1
    before = m.debug_snapshot()
    assert m.allocate_slots(1, 1) is None
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
