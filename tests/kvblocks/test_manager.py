"""BlockManager scenarios with exact block ids: paging, fork/copy-on-write, beam search, swapping,
prefix caching, eviction order, hash collisions, accounting."""

from __future__ import annotations

import pytest

from kvblocks import BlockLimitError, BlockManager, InvariantError, SwapSpaceError


class Lists(dict):
    """The test plays the caller, which owns each sequence's token list: kvblocks keeps a
    reference to it (tokens are stored once) and the caller appends to it."""

    def new(self, seq_id: int, tokens) -> list[int]:
        self[seq_id] = list(tokens)
        return self[seq_id]

    def fork(self, parent: int, child: int) -> list[int]:
        self[child] = self[parent].copy()
        return self[child]


def refs(m: BlockManager, pool: str = "gpu") -> list[int]:
    p = m.gpu_pool if pool == "gpu" else m.cpu_pool
    return [p.ref_count(b) for b in range(p.num_blocks)]


def test_on_demand_paging_exact_ids_and_slots() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=8)
    t = Lists()
    assert m.allocate(0, t.new(0, range(6))) == 0
    assert m.block_table(0) == [] and m.num_slots(0) == 0 and m.num_tokens(0) == 6
    assert m.allocate_slots(0, 6) == ()
    assert m.block_table(0) == [0, 1]
    assert m.slots(0, 0, 6) == [0, 1, 2, 3, 4, 5]
    assert m.allocate(1, t.new(1, [7, 7, 7])) == 0
    assert m.allocate_slots(1, 3) == ()
    assert m.block_table(1) == [2]
    assert m.slots(1, 0, 3) == [8, 9, 10]
    # Decode: one token at a time; a new block only when the last one is full.
    t[0].append(6)
    assert m.allocate_slots(0, 1) == () and m.block_table(0) == [0, 1] and m.slot(0, 6) == 6
    t[0].append(7)
    assert m.allocate_slots(0, 1) == () and m.block_table(0) == [0, 1] and m.num_slots(0) == 8
    t[0].append(8)
    assert m.blocks_needed(0, 1) == 1 and m.num_free_blocks == 5
    assert m.allocate_slots(0, 1) == () and m.block_table(0) == [0, 1, 3]
    assert m.slot(0, 8) == 12 and m.slots(0, 3, 9) == [3, 4, 5, 6, 7, 12]
    st = m.stats()
    assert (st.gpu_used, st.gpu_free, st.gpu_total) == (4, 4, 8)
    assert st.kv_utilization == pytest.approx((9 + 3) / 16)
    assert st.fragmentation == pytest.approx(1 - 12 / 16)
    assert st.gpu_usage == 0.5 and st.blocks_saved_by_sharing == 0
    # Free releases tail first; uncached blocks go to the head of the free queue.
    m.free(0)
    assert m.gpu_pool.free_block_ids() == [0, 1, 3, 4, 5, 6, 7]
    assert m.allocate(2, t.new(2, range(5))) == 0 and m.allocate_slots(2, 5) == ()
    assert m.block_table(2) == [0, 1]
    m.free(1)
    m.free(2)
    assert m.gpu_pool.num_free == 8 and m.num_seqs == 0


def test_fork_and_copy_on_write() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=8)
    t = Lists()
    m.allocate(0, t.new(0, range(6)))
    m.allocate_slots(0, 6)
    m.fork(0, 1, t.fork(0, 1))
    assert m.block_table(1) == [0, 1]
    assert m.token_ids(1) == list(range(6)) and m.num_slots(1) == 6
    assert refs(m)[:3] == [2, 2, 0]
    assert m.stats().blocks_saved_by_sharing == 2
    # The parent writes into the shared, partly filled block 1: it is copied to block 2.
    t[0].append(100)
    assert m.blocks_needed(0, 1) == 1
    assert m.allocate_slots(0, 1) == ((1, 2),)
    assert m.block_table(0) == [0, 2] and m.block_table(1) == [0, 1]
    assert refs(m)[:3] == [2, 1, 1]
    # The child now owns block 1 alone and writes in place.
    t[1].append(200)
    assert m.blocks_needed(1, 1) == 0
    assert m.allocate_slots(1, 1) == ()
    assert m.slot(0, 6) == 10 and m.slot(1, 6) == 6
    assert m.token_ids(0)[-1] == 100 and m.token_ids(1)[-1] == 200
    # Crossing a block boundary while block 0 stays shared: no copy, just a new block.
    t[0].extend([101, 102])
    assert m.allocate_slots(0, 2) == () and m.block_table(0) == [0, 2, 3]
    # Copy-on-write together with new blocks in one grow (prefill of a fork).
    m.fork(1, 2, t.fork(1, 2))
    t[2].extend(range(300, 306))
    assert m.blocks_needed(2, 6) == 3
    assert m.allocate_slots(2, 6) == ((1, 4),)
    assert m.block_table(2) == [0, 4, 5, 6]
    for s in (0, 1, 2):
        m.free(s)
    assert refs(m) == [0] * 8


def test_beam_search_fork_prune_sequence() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=6)
    t = Lists()
    m.allocate(0, t.new(0, [1, 2, 3]))
    assert m.allocate_slots(0, 3) == () and m.block_table(0) == [0]
    # Step 1: two beams out of the prompt.
    m.fork(0, 1, t.fork(0, 1))
    t[0].append(10)
    t[1].append(11)
    assert m.allocate_slots(0, 1) == ((0, 1),)
    assert m.allocate_slots(1, 1) == ()
    assert (m.block_table(0), m.block_table(1)) == ([1], [0])
    # Step 2: both best candidates extend beam 1; beam 0 is pruned.
    m.fork(1, 2, t.fork(1, 2))
    m.free(0)
    assert m.gpu_pool.free_block_ids() == [1, 2, 3, 4, 5]
    t[1].append(20)
    t[2].append(21)
    assert m.allocate_slots(1, 1) == () and m.allocate_slots(2, 1) == ()
    assert (m.block_table(1), m.block_table(2)) == ([0, 1], [0, 2])
    assert refs(m) == [2, 1, 1, 0, 0, 0]
    # Step 3: each beam keeps its own best continuation.
    t[1].append(30)
    t[2].append(31)
    assert m.allocate_slots(1, 1) == () and m.allocate_slots(2, 1) == ()
    # Step 4: both candidates come from beam 2; beam 1 is pruned; the shared partly filled
    # block 2 is copied on write into the block beam 1 just released.
    m.fork(2, 3, t.fork(2, 3))
    m.free(1)
    t[2].append(40)
    t[3].append(41)
    assert m.allocate_slots(2, 1) == ((2, 1),)
    assert m.allocate_slots(3, 1) == ()
    assert (m.block_table(2), m.block_table(3)) == ([0, 1], [0, 2])
    assert m.token_ids(2) == [1, 2, 3, 11, 21, 31, 40]
    assert m.token_ids(3) == [1, 2, 3, 11, 21, 31, 41]
    assert refs(m) == [2, 1, 1, 0, 0, 0]
    assert m.stats().blocks_saved_by_sharing == 1
    m.free(2)
    m.free(3)
    assert m.gpu_pool.num_free == 6


def _shared_group() -> tuple[BlockManager, Lists]:
    """seq 0 owns [0, 1]; seqs 1 and 2 are forks that copied block 1 on write.

    Block 0 is shared by 0, 1 and 2; the group {1, 2} holds blocks 0, 2, 3.
    """
    m = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4)
    t = Lists()
    m.allocate(0, t.new(0, range(6)))
    m.allocate_slots(0, 6)
    m.fork(0, 1, t.fork(0, 1))
    t[1].append(9)
    assert m.allocate_slots(1, 1) == ((1, 2),)
    m.fork(0, 2, t.fork(0, 2))
    t[2].append(8)
    assert m.allocate_slots(2, 1) == ((1, 3),)
    assert [m.block_table(s) for s in (0, 1, 2)] == [[0, 1], [0, 2], [0, 3]]
    return m, t


def test_swap_out_and_in_with_shared_blocks() -> None:
    m, t = _shared_group()
    assert m.num_group_blocks([1, 2]) == 3
    assert m.can_swap_out([1, 2])
    assert m.swap_out([1, 2]) == {0: 0, 2: 1, 3: 2}
    assert m.location(1) == m.location(2) == "cpu" and m.location(0) == "gpu"
    assert m.block_table(1) == [0, 1] and m.block_table(2) == [0, 2]
    assert refs(m, "cpu") == [2, 1, 1, 0]
    # GPU block 0 stays for seq 0; blocks 2 and 3 were released (tail first, to the head).
    assert refs(m)[:4] == [1, 1, 0, 0]
    assert m.gpu_pool.free_block_ids() == [3, 2, 4, 5, 6, 7]
    st = m.stats()
    assert (st.gpu_used, st.cpu_used, st.cpu_free) == (2, 3, 1)
    # The sequence left on the GPU keeps decoding meanwhile.
    t[0].extend([6, 7, 8])
    assert m.allocate_slots(0, 3) == () and m.block_table(0) == [0, 1, 3]
    assert m.can_swap_in([1, 2])
    assert m.swap_in([1, 2]) == {0: 2, 1: 4, 2: 5}
    assert m.block_table(1) == [2, 4] and m.block_table(2) == [2, 5]
    assert m.location(1) == "gpu"
    assert refs(m, "cpu") == [0, 0, 0, 0] and m.cpu_pool.num_free == 4
    # Block 2 holds the group's shared prefix once, for both sequences.
    assert refs(m)[:6] == [1, 1, 2, 1, 1, 1]
    t[1].append(1)
    assert m.allocate_slots(1, 1) == ()  # block 4 is owned by seq 1 alone
    for s in (0, 1, 2):
        m.free(s)
    assert m.gpu_pool.num_free == 8 and m.cpu_pool.num_free == 4


def test_swap_says_in_advance_when_it_does_not_fit() -> None:
    m, t = _shared_group()
    m.allocate(7, t.new(7, [1]))  # no block
    m.cpu_pool.allocate_n(2)  # only 2 CPU blocks left; the group needs 3
    assert not m.can_swap_out([1, 2])
    assert m.can_swap_out([1])
    before = m.debug_snapshot()
    with pytest.raises(SwapSpaceError, match="3 distinct blocks but the cpu pool has only 2"):
        m.swap_out([1, 2])
    assert m.debug_snapshot() == before
    assert m.swap_out([1]) == {0: 2, 2: 3}
    # Fill the GPU, then swapping in must refuse without moving anything.
    m.gpu_pool.allocate_n(m.gpu_pool.num_free - 1)
    assert not m.can_swap_in([1])
    before = m.debug_snapshot()
    with pytest.raises(SwapSpaceError, match="gpu pool has only 1 free"):
        m.swap_in([1])
    assert m.debug_snapshot() == before


def test_prefix_hits_exact_blocks_and_stats() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=10, enable_prefix_caching=True)
    t = Lists()
    a = list(range(10))
    assert m.allocate(0, t.new(0, a)) == 0
    assert m.allocate_slots(0, 10) == () and m.block_table(0) == [0, 1, 2]
    # Blocks 0 and 1 are full: published. Block 2 is partly filled: not cached.
    assert m.peek_prefix(a) == 8
    assert m.allocate(1, t.new(1, a)) == 8
    assert m.block_table(1) == [0, 1] and m.num_slots(1) == 8
    assert m.allocate_slots(1, 2) == () and m.block_table(1) == [0, 1, 3]
    # Diverging after two blocks, after one block, or another extra key.
    assert m.allocate(2, t.new(2, [*a[:8], 50, 51, 52, 53, 54])) == 8
    assert m.block_table(2) == [0, 1]
    assert m.allocate(3, t.new(3, [*a[:4], 99, 99, 99, 99, 99])) == 4 and m.block_table(3) == [0]
    assert m.allocate(4, t.new(4, a), extra_key="lora-1") == 0 and m.block_table(4) == []
    # At least one token is always left to compute: a prompt of exactly 2 blocks takes 1.
    assert m.allocate(5, t.new(5, a[:8])) == 4
    assert refs(m)[:4] == [5, 3, 1, 1]
    st = m.stats()
    # queries (blocks): 2 + 2 + 3 + 2 + 2 + 1; hits: 0 + 2 + 2 + 1 + 0 + 1
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (12, 6)
    assert st.prefix_cache_hit_rate == 0.5
    assert st.blocks_saved_by_sharing == 4 + 2
    assert st.prefix_cached_blocks == 2
    # peek_prefix counts no query and changes nothing.
    before = m.debug_snapshot()
    assert m.peek_prefix([*a[:8], 7]) == 8
    assert m.debug_snapshot() == before


def test_prefix_caching_off_returns_zero() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=4)
    t = Lists()
    m.allocate(0, t.new(0, range(9)))
    m.allocate_slots(0, 9)
    assert m.peek_prefix(range(9)) == 0
    assert m.blocks_needed_for(range(9)) == 3
    assert m.allocate(1, t.new(1, range(9))) == 0
    assert m.stats().prefix_cache_queries == 0


def test_eviction_order_under_memory_pressure() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=6, enable_prefix_caching=True)
    t = Lists()
    m.allocate(0, t.new(0, range(12)))
    m.allocate_slots(0, 12)
    m.allocate(1, t.new(1, range(100, 108)))
    m.allocate_slots(1, 8)
    assert (m.block_table(0), m.block_table(1)) == ([0, 1, 2], [3, 4])
    m.free(0)
    m.free(1)
    # Cached blocks stay, evictable, at the tail: each sequence's last block first.
    assert m.gpu_pool.free_block_ids() == [5, 2, 1, 0, 4, 3]
    st = m.stats()
    assert (st.gpu_free, st.gpu_used, st.prefix_cached_blocks) == (6, 0, 5)
    # Memory is needed: the uncached block 5 goes first, then the least recently freed
    # cached block (seq 0's last one).
    m.allocate(2, t.new(2, range(200, 206)))
    assert m.allocate_slots(2, 6) == () and m.block_table(2) == [5, 2]
    assert m.stats().prefix_cache_evictions == 1
    assert m.peek_prefix([*range(12), 1]) == 8
    # Admission: 2 cached blocks, both free now (evictable), plus 1 new block.
    assert m.blocks_needed_for([*range(100, 108), 7]) == 3
    assert m.blocks_needed_for([*range(100, 108), 7], extra_key=1) == 3
    # A hit takes blocks 3 and 4 out of the middle of the free queue.
    assert m.allocate(3, t.new(3, [*range(100, 108), 7])) == 8 and m.block_table(3) == [3, 4]
    assert m.gpu_pool.free_block_ids() == [1, 0]
    assert m.blocks_needed_for([*range(100, 108), 7, 8, 9, 10, 11]) == 2  # 2 shared in use
    m.allocate(4, t.new(4, range(300, 308)))
    m.allocate_slots(4, 8)
    assert m.block_table(4) == [1, 0]
    assert m.peek_prefix([*range(12), 1]) == 0
    assert m.stats().prefix_cache_evictions == 3


def test_constant_hash_never_shares_a_wrong_block() -> None:
    m = BlockManager(
        block_size=4, num_gpu_blocks=8, enable_prefix_caching=True, hash_fn=lambda p, t, e: 0
    )
    t = Lists()
    m.allocate(0, t.new(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    m.allocate_slots(0, 9)
    assert m.block_table(0) == [0, 1, 2]
    # Block 0 was cached; block 1 collides with it and is refused.
    assert m.stats().prefix_cached_blocks == 1
    assert m.allocate(1, t.new(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])) == 4 and m.block_table(1) == [0]
    assert m.allocate(2, t.new(2, [9, 9, 9, 9, 5, 6, 7, 8, 1])) == 0
    assert m.allocate(3, t.new(3, [1, 2, 3, 4, 1, 2, 3, 4, 0])) == 4 and m.block_table(3) == [0]
    assert m.allocate(4, t.new(4, [1, 2, 3, 4, 0]), extra_key="x") == 0


def test_collision_after_eviction_never_shares_a_stale_child() -> None:
    """A hash that ignores a block's first token makes [1,2,3,4] and [9,2,3,4] collide.

    The child entry of an evicted parent keeps the parent's hash; when a different block is
    later cached under that same hash, comparing parent hashes is not enough: the entry also
    names its parent entry (serial), so the stale child is not matched.
    """
    m = BlockManager(
        block_size=4,
        num_gpu_blocks=6,
        enable_prefix_caching=True,
        hash_fn=lambda p, t, e: hash((p, t[1:], e)),
    )
    t = Lists()
    m.allocate(0, t.new(0, [1, 2, 3, 4, 50]))
    m.allocate(1, t.new(1, [1, 2, 3, 4, 5, 6, 7, 8, 60]))
    m.allocate_slots(0, 5)  # block 0 = [1,2,3,4] is cached
    m.allocate_slots(1, 9)  # block 2 duplicates it; block 3 = [5,6,7,8] is cached as its child
    assert (m.block_table(0), m.block_table(1)) == ([0, 1], [2, 3, 4])
    m.free(0)
    m.allocate(2, t.new(2, range(70, 79)))
    m.allocate_slots(2, 9)  # needs three blocks: 1, 5 and 0 (the cached parent is evicted)
    assert m.block_table(2) == [1, 5, 0]
    m.free(2)
    m.allocate(3, t.new(3, [9, 2, 3, 4, 99]))
    m.allocate_slots(3, 5)  # [9,2,3,4] is cached under the evicted parent's hash
    assert m.peek_prefix([9, 2, 3, 4, 1]) == 4
    # Same parent hash, same tokens, but the KV of block 3 was computed after [1,2,3,4].
    assert m.peek_prefix([9, 2, 3, 4, 5, 6, 7, 8, 1]) == 4
    assert m.allocate(4, t.new(4, [9, 2, 3, 4, 5, 6, 7, 8, 1])) == 4
    assert m.block_table(4) == m.block_table(3)[:1]
    # And the original prefix is gone.
    assert m.peek_prefix([1, 2, 3, 4, 5, 6, 7, 8, 1]) == 0
    # The stale child cannot be matched any more, so it gives its hash up to the live chain.
    m.free(3)
    assert m.allocate_slots(4, 5) == ()
    assert m.block_table(4) == [0, 5, 1] and m.num_cached_tokens(4) == 8
    assert not m.gpu_pool.is_cached(3) and m.block_table(1) == [2, 3, 4]
    assert m.peek_prefix([9, 2, 3, 4, 5, 6, 7, 8, 1]) == 8
    m.check_invariants()


def test_swap_in_republishes_prefix_blocks() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=4, enable_prefix_caching=True)
    t = Lists()
    m.allocate(0, t.new(0, range(9)))
    m.allocate_slots(0, 9)
    assert m.swap_out([0]) == {0: 0, 1: 1, 2: 2}
    # The GPU copies stay cached: free queue = uncached 2, 3, then cached 1, 0.
    assert m.gpu_pool.free_block_ids() == [2, 3, 1, 0]
    assert m.peek_prefix([*range(8), 1]) == 8
    # Fill the GPU so that the cached copies are evicted.
    m.allocate(1, t.new(1, range(50, 66)))
    m.allocate_slots(1, 16)
    assert m.block_table(1) == [2, 3, 1, 0]
    m.free(1)
    assert m.peek_prefix([*range(8), 1]) == 0
    assert m.swap_in([0]) == {0: 0, 1: 1, 2: 3}
    assert m.peek_prefix([*range(8), 1]) == 8
    assert m.num_cached_tokens(0) == 8


def test_max_blocks_per_seq() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=8, max_blocks_per_seq=2)
    t = Lists()
    m.allocate(0, t.new(0, range(8)))
    t[0].append(8)
    before = m.debug_snapshot()
    with pytest.raises(BlockLimitError, match="max_blocks_per_seq=2"):
        m.allocate_slots(0, 9)
    assert m.debug_snapshot() == before
    m.allocate_slots(0, 8)
    assert m.block_table(0) == [0, 1]


def test_stats_utilization_counts_shared_blocks_once() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=2)
    t = Lists()
    st = m.stats()
    assert (st.kv_utilization, st.fragmentation, st.gpu_usage) == (1.0, 0.0, 0.0)
    m.allocate(0, t.new(0, range(5)))
    m.allocate_slots(0, 5)
    m.fork(0, 1, t.fork(0, 1))
    st = m.stats()
    # Blocks 0 (4 slots) and 1 (1 slot) used, shared by two sequences.
    assert st.kv_utilization == pytest.approx(5 / 8)
    assert st.blocks_saved_by_sharing == 2 and st.num_sequences == 2
    d = st.as_dict()
    assert d["gpu_used"] == 2 and d["cpu_total"] == 2 and "prefix_cache_hit_rate" in d


# --------------------------------------------------------- tokens stored once
def test_the_manager_reads_the_callers_token_list_by_reference() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=8, enable_prefix_caching=True)
    tokens = [1, 2, 3]
    m.allocate(0, tokens)
    assert m.allocate_slots(0, 3) == ()
    # The caller appends; the manager sees it at once (nothing to tell it).
    tokens.append(4)
    assert m.num_tokens(0) == 4
    assert m.allocate_slots(0, 1) == ()  # fills block 0: hashed from the caller's list
    assert m.peek_prefix([1, 2, 3, 4, 9]) == 4
    # The manager never changes the list, and a query returns a copy.
    assert tokens == [1, 2, 3, 4] and m.token_ids(0) is not tokens
    m.free(0)
    assert tokens == [1, 2, 3, 4]


@pytest.mark.parametrize("bad", [range(3), (1, 2, 3), iter([1, 2, 3])])
def test_allocate_needs_a_list_the_caller_owns(bad) -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=8)
    before = m.debug_snapshot()
    with pytest.raises(ValueError, match="must be a list that you own"):
        m.allocate(0, bad)
    assert m.debug_snapshot() == before and not m.has_seq(0)


def test_fork_takes_the_childs_own_copy_of_the_tokens() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=8)
    parent = [1, 2, 3, 4, 5]
    m.allocate(0, parent)
    m.allocate_slots(0, 5)
    before = m.debug_snapshot()
    with pytest.raises(ValueError, match="own new list"):
        m.fork(0, 1, parent)  # appending to one would append to both
    with pytest.raises(ValueError, match="own new list"):
        m.fork(0, 1, tuple(parent))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must equal the parent's 5 tokens"):
        m.fork(0, 1, [1, 2, 3, 4, 9])
    with pytest.raises(ValueError, match="must equal the parent's 5 tokens"):
        m.fork(0, 1, [1, 2, 3, 4])
    assert m.debug_snapshot() == before
    child = parent.copy()
    m.fork(0, 1, child)
    parent.append(6)
    child.append(7)
    assert (m.num_tokens(0), m.num_tokens(1)) == (6, 6)
    assert m.allocate_slots(1, 1) == ((1, 2),)
    assert m.allocate_slots(0, 1) == ()
    assert m.token_ids(0)[-1] == 6 and m.token_ids(1)[-1] == 7
    m.check_invariants()


def test_check_invariants_catches_a_token_list_shared_by_two_sequences() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=8)
    tokens = [1, 2, 3]
    m.allocate(0, tokens)
    m.allocate(1, tokens)  # a caller's bug: the manager cannot tell cheaply at allocate()
    with pytest.raises(InvariantError, match="shares its token list"):
        m.check_invariants()



def _busy_manager() -> BlockManager:
    """A manager with every kind of bookkeeping in use: shared (forked) blocks, a partly
    filled last block, a swapped-out sequence, published prefix-cache entries."""
    m = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8,
                     enable_prefix_caching=True)
    parent = list(range(1, 11))  # 10 tokens: two full blocks and half of a third
    m.allocate(0, parent)
    assert m.allocate_slots(0, 10) == ()
    m.fork(0, 1, parent.copy())
    for seq_id, tokens in ((2, [7, 7, 7, 7, 8]), (3, [5, 6])):
        m.allocate(seq_id, tokens)
        assert m.allocate_slots(seq_id, len(tokens)) == ()
    m.swap_out([3])
    m.check_invariants()
    assert m.gpu_pool.ref_count(m.block_table(1)[-1]) == 2 and m.location(3) == "cpu"
    return m


def _corrupt_block_count(m: BlockManager) -> None:
    m._seqs[0].blocks.append(m.gpu_pool.allocate())


def _corrupt_slots(m: BlockManager) -> None:
    m._seqs[2].num_slots = 12  # three blocks' worth of slots on two blocks


def _corrupt_fast_left(m: BlockManager) -> None:
    m._seqs[1].fast_left = 3  # its last block is shared with seq 0: no fast path


def _corrupt_ref_count(m: BlockManager) -> None:
    m.gpu_pool._ref[m.block_table(2)[0]] += 1


def _corrupt_free_queue(m: BlockManager) -> None:
    m.gpu_pool._num_free += 1


def _corrupt_cpu_table(m: BlockManager) -> None:
    m._seqs[3].blocks[0] = m.cpu_pool.free_block_ids()[0]  # a free host block


def _corrupt_cache_mark(m: BlockManager) -> None:
    entry = next(iter(m._cache.entries()))  # type: ignore[union-attr]
    m.gpu_pool._cached[entry.block_id] = False


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_block_count, "blocks for"),
        (_corrupt_slots, "more slots than tokens"),
        (_corrupt_fast_left, "stale fast_left"),
        (_corrupt_ref_count, "ref count"),
        (_corrupt_free_queue, "free queue"),
        (_corrupt_cpu_table, "cpu block"),
        (_corrupt_cache_mark, "not marked"),
    ],
)
def test_check_invariants_catches_each_kind_of_corruption(corrupt, message: str) -> None:
    """check_invariants is what the property tests lean on: each of its checks must fire on
    the corruption it exists for (a check that never fires would pass every test)."""
    m = _busy_manager()
    corrupt(m)
    with pytest.raises(InvariantError, match=message):
        m.check_invariants()

# ------------------------------------------------------------ allocate_slots
def test_allocate_slots_returns_none_when_blocks_run_out_and_changes_nothing() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=3)
    t = Lists()
    m.allocate(0, t.new(0, range(6)))
    assert m.allocate_slots(0, 6) == ()
    m.allocate(1, t.new(1, range(9)))
    assert m.blocks_needed(1, 9) == 3 and m.num_free_blocks == 1
    before = m.debug_snapshot()
    assert m.allocate_slots(1, 9) is None
    assert m.debug_snapshot() == before
    # Copy-on-write needs a block too: a fork that writes into the shared last block.
    m.allocate_slots(1, 4)  # takes the last free block
    m.fork(0, 2, t.fork(0, 2))
    t[2].append(99)
    assert m.blocks_needed(2, 1) == 1 and m.num_free_blocks == 0
    before = m.debug_snapshot()
    assert m.allocate_slots(2, 1) is None
    assert m.debug_snapshot() == before
    # Memory comes back: the same call succeeds.
    m.free(1)
    assert m.allocate_slots(2, 1) == ((1, 2),)
    m.check_invariants()


def test_pending_slot_for_a_token_being_sampled() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=4)
    tokens = [1, 2]
    m.allocate(0, tokens)
    assert m.allocate_slots(0, 2) == ()
    with pytest.raises(ValueError, match="only 2 known tokens"):
        m.allocate_slots(0, 1)
    assert m.allocate_slots(0, 1, pending=1) == ()  # position 2: its token is on its way
    assert m.num_slots(0) == 3
    with pytest.raises(ValueError, match="only 2 known tokens"):
        m.allocate_slots(0, 1, pending=1)  # only one token can be on its way
    with pytest.raises(ValueError, match="pending must be 0 or 1"):
        m.allocate_slots(0, 1, pending=2)
    tokens.append(3)
    m.check_invariants()
    cached = BlockManager(block_size=4, num_gpu_blocks=4, enable_prefix_caching=True)
    cached.allocate(0, [1, 2])
    with pytest.raises(ValueError, match="prefix caching cannot hash"):
        cached.allocate_slots(0, 3, pending=1)


# ------------------------------------------------------------- asking first
def test_group_blocks_needed_counts_the_last_in_place_writer_once() -> None:
    """Three samples of one request share a partly filled block: two copy it, the third
    writes in place; a block also used outside the group is copied by all of them."""
    m = BlockManager(block_size=4, num_gpu_blocks=10)
    t = Lists()
    m.allocate(0, t.new(0, range(6)))
    m.allocate_slots(0, 6)
    m.fork(0, 1, t.fork(0, 1))
    m.fork(0, 2, t.fork(0, 2))
    for s in (0, 1, 2):
        t[s].append(50 + s)
    assert [m.blocks_needed(s, 1) for s in (0, 1, 2)] == [1, 1, 1]
    assert m.group_blocks_needed([0, 1, 2], [1, 1, 1]) == 2
    assert m.group_blocks_needed([0, 1], [1, 1]) == 2  # seq 2 also holds the block
    assert m.group_blocks_needed([0, 1, 2], [1, 0, 1]) == 2
    assert m.group_blocks_needed([0, 1, 2], [0, 0, 0]) == 0
    free = m.num_free_blocks
    copies = [m.allocate_slots(s, 1) for s in (0, 1, 2)]
    assert free - m.num_free_blocks == 2
    assert copies == [((1, 2),), ((1, 3),), ()]
    with pytest.raises(ValueError, match="names a sequence twice"):
        m.group_blocks_needed([0, 0], [1, 1])
    with pytest.raises(ValueError, match="one per sequence"):
        m.group_blocks_needed([0, 1], [1])


def test_blocks_needed_to_admit_counts_shared_evictable_hits_once() -> None:
    m = BlockManager(block_size=4, num_gpu_blocks=10, enable_prefix_caching=True)
    t = Lists()
    m.allocate(0, t.new(0, range(9)))
    m.allocate_slots(0, 9)  # blocks 0 and 1 cached
    m.free(0)  # ... and free now: evictable
    a, b = [*range(8), 70, 71], [*range(8), 80]
    assert m.peek_prefix(a) == m.peek_prefix(b) == 8
    # Two sequences of one request hit the same 2 evictable blocks: they cost 2, not 4.
    assert m.blocks_needed_to_admit([a, b], [2, 1]) == 2 + 1 + 1
    assert m.blocks_needed_to_admit([a, b]) == m.blocks_needed_to_admit([a, b], [2, 1])
    assert m.blocks_needed_to_admit([a], [1]) == 2 + 1
    assert m.blocks_needed_for(a) == 3
    # Another extra key: no hit, the chunk starts at position 0.
    assert m.blocks_needed_to_admit([a], [1], extra_key="other") == 1
    assert m.blocks_needed_to_admit([a], [10], extra_key="other") == 3
    with pytest.raises(ValueError, match="exceed"):
        m.blocks_needed_to_admit([a], [3])  # only 2 tokens past the cached 8
    # What admission then takes is exactly what it said.
    free = m.num_free_blocks
    m.allocate(1, t.new(1, a))
    m.allocate(2, t.new(2, b))
    m.allocate_slots(1, 2)
    m.allocate_slots(2, 1)
    assert free - m.num_free_blocks == 4


def test_blocks_needed_to_swap_in_is_an_upper_bound() -> None:
    m, t = _shared_group()  # group {1, 2}: blocks 0 (shared), 2, 3; 5 slots each
    m.swap_out([1, 2])
    with pytest.raises(Exception, match="already on the GPU"):
        m.blocks_needed_to_swap_in([0], [1])
    need = m.blocks_needed_to_swap_in([1, 2], [1, 1])
    # 3 distinct blocks, + per sequence 0 new blocks and a possible copy-on-write.
    assert need == 3 + 2
    free = m.num_free_blocks
    m.swap_in([1, 2])
    for s in (1, 2):
        t[s].append(5)
    assert m.group_blocks_needed([1, 2], [1, 1]) == 0
    assert free - m.num_free_blocks <= need
