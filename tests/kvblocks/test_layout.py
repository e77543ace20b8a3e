"""The block size check and the slot rule, defined once in kvblocks.layout and used everywhere."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvblocks import BlockManager, check_block_size, slot_of


@pytest.mark.parametrize("bs", [1, 2, 4, 8, 16, 32, 64, 1024])
def test_powers_of_two_are_valid_block_sizes(bs: int) -> None:
    assert check_block_size(bs) == bs


@pytest.mark.parametrize("bad", [0, -16, 3, 12, 24, 16.0, "16", True, None])
def test_everything_else_is_refused_with_a_clear_message(bad: object) -> None:
    with pytest.raises(ValueError, match=r"block_size must be a power of two .* got"):
        check_block_size(bad)


def test_manager_validates_with_the_same_function() -> None:
    with pytest.raises(ValueError, match="power of two"):
        BlockManager(block_size=12, num_gpu_blocks=4)
    assert BlockManager(block_size=8, num_gpu_blocks=4).block_size == 8


def test_slot_rule_examples() -> None:
    table = [7, 2, 5]
    assert [slot_of(table, p, 4) for p in range(12)] == [
        28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23,
    ]  # fmt: skip


@given(
    bs_exp=st.integers(0, 6),
    blocks=st.lists(st.integers(0, 1000), min_size=1, max_size=20, unique=True),
    data=st.data(),
)
def test_manager_slots_follow_the_slot_rule(bs_exp: int, blocks: list[int], data) -> None:
    """BlockManager.slot and .slots agree with slot_of (and slot_of with its definition),
    whatever the block table looks like."""
    bs = 1 << bs_exp
    num_blocks = max(blocks) + 1
    m = BlockManager(block_size=bs, num_gpu_blocks=num_blocks)
    # Take every block once so that the table gets exactly `blocks`, in that order.
    m.gpu_pool.allocate_n(num_blocks)
    for b in blocks:
        m.gpu_pool.decref(b)  # freed in this order: the last one is allocated first
    n = data.draw(st.integers(1, len(blocks) * bs))
    tokens = list(range(n))
    m.allocate(0, tokens)
    assert m.allocate_slots(0, n) == ()
    table = m.block_table(0)
    assert table == list(reversed(blocks))[: len(table)]
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    expected = [table[p // bs] * bs + p % bs for p in range(start, end)]
    assert [slot_of(table, p, bs) for p in range(start, end)] == expected
    assert [m.slot(0, p) for p in range(start, end)] == expected
    assert m.slots(0, start, end) == expected
