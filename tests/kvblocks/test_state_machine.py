"""Random operation sequences against the block manager, checked after every step.

The machine plays the caller: it owns each sequence's token list (kvblocks keeps a reference and
only reads it) and appends to it. It keeps a shadow of the KV memory: every slot that
`allocate_slots` reserves is "written" with
the full context of its position (the token ids up to and including it), copy-on-write pairs and
swap maps are carried out on the shadow, and after every step each sequence must read back its
own context from its slots. That one check catches wrong sharing (a prefix hit or a fork giving
a block with other content), a write into a shared block, and a wrong swap plan. Besides, the
pools are audited independently of the manager's own bookkeeping:

* every block is either free (in the free queue) or referenced, never both;
* a block's ref count equals the number of block-table entries naming it: the prefix cache holds
  no reference (its unreferenced blocks sit in the free queue, evictable);
* free + used == total, per pool; uncached free blocks come before cached ones in the queue;
* a table has exactly ceil(num_slots / block_size) blocks (waste <= one partly filled block);
* after every sequence is freed, no block is leaked;
* `allocate_slots` returns None exactly when `blocks_needed` exceeds `num_free_blocks`, and then
  changes nothing (full snapshots compared); the group and admission counts are exact.

The manager is built with the default hash, a constant hash (every block collides) or a hash
that ignores a block's first token (collisions that keep parent hashes equal).
"""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvblocks import BlockManager, SwapSpaceError

BS = 4
MAX_SEQS = 10

HASHES = {
    "default": None,
    "constant": lambda p, t, e: 0,
    "ignore_first_token": lambda p, t, e: hash((p, t[1:], e)),
}

# Prompts share prefixes (so prefix caching hits) and draw suffixes from a tiny alphabet (so
# equal blocks appear by chance too).
PREFIXES = [
    [],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23],
    [30, 2, 3, 4, 5, 6, 7, 8],
]
prompts = st.builds(
    lambda i, cut, suffix: PREFIXES[i][:cut] + suffix,
    st.sampled_from([0, 1, 1, 2, 2, 3]),
    st.one_of(st.integers(0, 12), st.sampled_from([4, 8, 12])),
    st.lists(st.integers(0, 3), min_size=1, max_size=6),
)
picks = st.integers(0, 255)


class KVBlocksMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: BlockManager | None = None
        self.tokens: dict[int, list[int]] = {}  # the caller's token lists
        self.kv: dict[str, dict[int, tuple[int, ...]]] = {"gpu": {}, "cpu": {}}
        self.next_id = 0

    @initialize(
        num_gpu=st.integers(3, 20),
        num_cpu=st.integers(0, 10),
        caching=st.sampled_from([True, True, True, False]),
        hash_kind=st.sampled_from(["default", "default", "constant", "ignore_first_token"]),
    )
    def setup(self, num_gpu: int, num_cpu: int, caching: bool, hash_kind: str) -> None:
        self.m = BlockManager(
            block_size=BS,
            num_gpu_blocks=num_gpu,
            num_cpu_blocks=num_cpu,
            enable_prefix_caching=caching,
            hash_fn=HASHES[hash_kind],
        )

    # ---------------------------------------------------------------- helpers
    def ids(self, where: str | None = None) -> list[int]:
        return [s for s in self.m.seq_ids() if where is None or self.m.location(s) == where]

    def pick(self, i: int, where: str | None = None) -> int | None:
        ids = self.ids(where)
        return ids[i % len(ids)] if ids else None

    def pool(self, where: str):
        return self.m.gpu_pool if where == "gpu" else self.m.cpu_pool

    def _grow(self, s: int, n: int) -> None:
        m = self.m
        old = m.num_slots(s)
        need = m.blocks_needed(s, n)
        free_before = m.num_free_blocks
        assert free_before == m.gpu_pool.num_free
        if need > free_before:
            before = m.debug_snapshot()
            assert m.allocate_slots(s, n) is None
            assert m.debug_snapshot() == before
            event("allocate_slots refused: no free blocks")
            return
        copies = m.allocate_slots(s, n)
        assert copies is not None, "None although blocks_needed <= num_free_blocks"
        assert free_before - m.gpu_pool.num_free == need
        assert len(copies) <= 1
        if copies:
            event("copy-on-write")
        kv = self.kv["gpu"]
        for src, dst in copies:
            for off in range(BS):
                v = kv.get(src * BS + off)
                if v is None:
                    kv.pop(dst * BS + off, None)
                else:
                    kv[dst * BS + off] = v
        tokens = m.token_ids(s)
        table = m.block_table(s)
        for p in range(old, old + n):
            b = table[p // BS]
            # Never write into a block someone else also reads.
            assert m.gpu_pool.ref_count(b) == 1, f"write into shared block {b}"
            kv[m.slot(s, p)] = tuple(tokens[: p + 1])

    def _copy_blocks(self, mapping: dict[int, int], src: str, dst: str) -> None:
        a, b = self.kv[src], self.kv[dst]
        for s_blk, d_blk in mapping.items():
            for off in range(BS):
                v = a.get(s_blk * BS + off)
                if v is None:
                    b.pop(d_blk * BS + off, None)
                else:
                    b[d_blk * BS + off] = v

    # ------------------------------------------------------------------ rules
    @rule(
        prompt=prompts,
        extra=st.sampled_from([None, None, "x"]),
        prefill=st.sampled_from([True, True, True, False]),
    )
    def allocate(self, prompt: list[int], extra: str | None, prefill: bool) -> None:
        m = self.m
        if m.num_seqs >= MAX_SEQS:
            return
        s = self.next_id
        self.next_id += 1
        expected = m.peek_prefix(prompt, extra_key=extra)
        admit = m.blocks_needed_for(prompt, extra_key=extra)
        assert admit == m.blocks_needed_to_admit(
            [prompt], [len(prompt) - expected], extra_key=extra
        )
        free0 = m.gpu_pool.num_free
        q0 = m.stats().prefix_cache_queries
        self.tokens[s] = tokens = list(prompt)
        cached = m.allocate(s, tokens, extra_key=extra)
        assert cached == expected
        if cached:
            event("prefix hit")
        assert cached % BS == 0 and cached <= (len(prompt) - 1) // BS * BS
        assert m.num_slots(s) == cached and len(m.block_table(s)) == cached // BS
        if m.enable_prefix_caching:
            assert m.stats().prefix_cache_queries - q0 == (len(prompt) - 1) // BS
        else:
            assert cached == 0
        if prefill and m.blocks_needed(s, len(prompt) - cached) <= m.num_free_blocks:
            self._grow(s, len(prompt) - cached)
            assert free0 - m.gpu_pool.num_free == admit
        elif prefill:
            self._grow(s, len(prompt) - cached)  # checks that it refuses

    @rule(i=picks, quarters=st.integers(1, 4))
    def grow(self, i: int, quarters: int) -> None:
        s = self.pick(i, "gpu")
        if s is None:
            return
        room = self.m.num_tokens(s) - self.m.num_slots(s)
        if room:
            self._grow(s, max(1, room * quarters // 4))

    @rule(i=picks, toks=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, i: int, toks: list[int]) -> None:
        s = self.pick(i)
        if s is None:
            return
        n = self.m.num_tokens(s)
        self.tokens[s].extend(toks)
        assert self.m.num_tokens(s) == n + len(toks)

    @rule(i=picks, tok=st.integers(0, 3))
    def decode(self, i: int, tok: int) -> None:
        """The common step: catch up with the known tokens, then one new token."""
        s = self.pick(i, "gpu")
        if s is None:
            return
        room = self.m.num_tokens(s) - self.m.num_slots(s)
        if room:
            self._grow(s, room)
        self.tokens[s].append(tok)
        self._grow(s, 1)

    @rule(i=picks)
    def fork(self, i: int) -> None:
        m = self.m
        parent = self.pick(i)
        if parent is None or m.num_seqs >= MAX_SEQS:
            return
        child = self.next_id
        self.next_id += 1
        self.tokens[child] = self.tokens[parent].copy()
        m.fork(parent, child, self.tokens[child])
        assert m.block_table(child) == m.block_table(parent)
        assert m.token_ids(child) == m.token_ids(parent)
        assert m.num_slots(child) == m.num_slots(parent)
        assert m.location(child) == m.location(parent)

    @rule(i=picks, toks=st.tuples(st.integers(0, 3), st.integers(0, 3)))
    def beam_step(self, i: int, toks: tuple[int, int]) -> None:
        """Fork a running sequence and let parent and child each decode one token."""
        m = self.m
        parent = self.pick(i, "gpu")
        if parent is None or m.num_seqs >= MAX_SEQS:
            return
        child = self.next_id
        self.next_id += 1
        self.tokens[child] = self.tokens[parent].copy()
        m.fork(parent, child, self.tokens[child])
        for s, tok in ((parent, toks[0]), (child, toks[1])):
            room = m.num_tokens(s) - m.num_slots(s)
            if room:
                self._grow(s, room)
            self.tokens[s].append(tok)
            self._grow(s, 1)

    @rule(i=picks, tok=st.integers(0, 3), quarters=st.integers(0, 4))
    def group_decode(self, i: int, tok: int, quarters: int) -> None:
        """A sequence group (all GPU sequences sharing a block with the picked one) grows
        together, as the scheduler grows parallel samples: `group_blocks_needed` must be the
        exact number of blocks taken, whatever the order of the growth."""
        m = self.m
        first = self.pick(i, "gpu")
        if first is None:
            return
        mine = set(m.block_table(first))
        group = [first] + [
            s for s in self.ids("gpu") if s != first and mine & set(m.block_table(s))
        ]
        ns = []
        for s in group:
            self.tokens[s].append(tok)
            room = m.num_tokens(s) - m.num_slots(s)
            ns.append(room if quarters == 4 else room * quarters // 4)
        need = m.group_blocks_needed(group, ns)
        assert need <= sum(m.blocks_needed(s, n) for s, n in zip(group, ns))
        if need > m.num_free_blocks:
            event("group does not fit")
            return
        free0 = m.num_free_blocks
        for s, n in reversed(list(zip(group, ns))):
            if n:
                self._grow(s, n)
        assert free0 - m.num_free_blocks == need
        if len(group) > 1:
            event("group growth")

    @rule(i=picks)
    def free(self, i: int) -> None:
        s = self.pick(i)
        if s is not None:
            self.m.free(s)
            del self.tokens[s]

    @rule(picks_=st.lists(picks, min_size=1, max_size=4), family=st.booleans())
    def swap_out(self, picks_: list[int], family: bool) -> None:
        self._swap(picks_, "gpu", "cpu", family)

    @rule(picks_=st.lists(picks, min_size=1, max_size=4), family=st.booleans())
    def swap_in(self, picks_: list[int], family: bool) -> None:
        self._swap(picks_, "cpu", "gpu", family)

    def _swap(self, picks_: list[int], src: str, dst: str, family: bool) -> None:
        m = self.m
        if not self.ids(src):
            return
        group = list(dict.fromkeys(self.pick(i, src) for i in picks_))
        if family:
            # A sequence group: everything that shares a block with the first pick.
            mine = set(m.block_table(group[0]))
            group += [s for s in self.ids(src) if s not in group and mine & set(m.block_table(s))]
        distinct = {b for s in group for b in m.block_table(s)}
        if dst == "gpu":
            bound = m.blocks_needed_to_swap_in(group, [0] * len(group))
            assert len(distinct) <= bound <= len(distinct) + len(group)
        can = m.can_swap_out(group) if dst == "cpu" else m.can_swap_in(group)
        assert can == (len(distinct) <= self.pool(dst).num_free)
        op = m.swap_out if dst == "cpu" else m.swap_in
        if not can:
            before = m.debug_snapshot()
            with pytest.raises(SwapSpaceError):
                op(group)
            assert m.debug_snapshot() == before
            event(f"{dst}: swap refused")
            return
        tables = {s: m.block_table(s) for s in group}
        mapping = op(group)
        # Each distinct block moves exactly once, to a distinct block, and stays shared.
        assert set(mapping) == distinct
        assert len(set(mapping.values())) == len(mapping)
        for s in group:
            assert m.location(s) == dst
            assert m.block_table(s) == [mapping[b] for b in tables[s]]
        self._copy_blocks(mapping, src, dst)
        event(
            f"swap to {dst}"
            + (" (shared blocks)" if len(mapping) < sum(map(len, tables.values())) else "")
        )

    @rule(i=picks, kind=st.integers(0, 4))
    def misuse(self, i: int, kind: int) -> None:
        m = self.m
        s = self.pick(i)
        if s is None:
            return
        before = m.debug_snapshot()
        with pytest.raises((ValueError, KeyError, Exception)) as info:
            if kind == 0:
                m.free(10**9)
            elif kind == 1:
                m.fork(s, s, self.tokens[s].copy())
            elif kind == 2:
                (m.swap_in if m.location(s) == "gpu" else m.swap_out)([s])
            elif kind == 3:
                m.allocate(s, [1, 2])
            else:
                m.slot(s, m.num_slots(s))
        assert type(info.value).__module__ in ("kvblocks.errors", "builtins")
        assert m.debug_snapshot() == before

    @rule()
    def reset_prefix_cache(self) -> None:
        self.m.reset_prefix_cache()

    # ------------------------------------------------------------- invariants
    @invariant()
    def pools_agree_with_block_tables(self) -> None:
        m = self.m
        if m is None:
            return
        expected = {"gpu": [0] * m.gpu_pool.num_blocks, "cpu": [0] * m.cpu_pool.num_blocks}
        filled: dict[int, int] = {}
        for s in m.seq_ids():
            where = m.location(s)
            table = m.block_table(s)
            n = m.num_slots(s)
            assert len(table) == -(-n // BS), "not on demand / over-allocated"
            assert n <= m.num_tokens(s)
            for b in table:
                expected[where][b] += 1
            if where == "gpu":
                for p in range(n):
                    b = table[p // BS]
                    filled[b] = max(filled.get(b, 0), p % BS + 1)
        for where in ("gpu", "cpu"):
            pool = self.pool(where)
            free = pool.free_block_ids()
            assert len(free) == len(set(free)) == pool.num_free
            assert pool.num_free + pool.num_used == pool.num_blocks
            fset = set(free)
            for b in range(pool.num_blocks):
                assert pool.ref_count(b) == expected[where][b], (where, b)
                assert (b in fset) == (expected[where][b] == 0), (where, b)
            cached_flags = [pool.is_cached(b) for b in free]
            assert cached_flags == sorted(cached_flags), "uncached free blocks must come first"
        st_ = m.stats()
        used = m.gpu_pool.num_used
        assert (st_.gpu_used, st_.gpu_free) == (used, m.gpu_pool.num_free)
        assert st_.blocks_saved_by_sharing == sum(max(0, r - 1) for r in expected["gpu"])
        util = sum(filled.values()) / (used * BS) if used else 1.0
        assert st_.kv_utilization == pytest.approx(util)
        assert st_.prefix_cache_hits <= st_.prefix_cache_queries
        if not m.num_seqs:
            assert m.gpu_pool.num_free == m.gpu_pool.num_blocks
            assert m.cpu_pool.num_free == m.cpu_pool.num_blocks

    @invariant()
    def every_sequence_reads_its_own_kv(self) -> None:
        m = self.m
        if m is None:
            return
        for s in m.seq_ids():
            kv = self.kv[m.location(s)]
            tokens = m.token_ids(s)
            for p, slot in enumerate(m.slots(s, 0, m.num_slots(s))):
                assert kv.get(slot) == tuple(tokens[: p + 1]), (s, p, slot)

    def teardown(self) -> None:
        m = self.m
        if m is None:
            return
        if m.stats().prefix_cache_evictions:
            event("prefix cache evicted blocks")
        m.check_invariants()
        for s in m.seq_ids():
            m.free(s)
            del self.tokens[s]
        assert m.gpu_pool.num_free == m.gpu_pool.num_blocks
        assert m.cpu_pool.num_free == m.cpu_pool.num_blocks
        assert all(m.gpu_pool.ref_count(b) == 0 for b in range(m.gpu_pool.num_blocks))
        m.check_invariants()


KVBlocksMachine.TestCase.settings = settings(
    max_examples=1000, stateful_step_count=30, deadline=None
)
test_kvblocks_state_machine = pytest.mark.slow(KVBlocksMachine.TestCase)
