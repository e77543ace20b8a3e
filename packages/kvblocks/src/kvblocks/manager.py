"""BlockManager: block tables of all sequences over a GPU pool and a CPU (swap) pool.

Why it exists: PagedAttention lets each sequence see contiguous logical blocks while its KV lives
in physical blocks scattered over memory. This module decides which physical block backs which
logical block, and nothing else: it speaks in ints (sequence ids, block ids, slots), never
touches tensors, and returns plans (copy-on-write pairs, swap maps) that the model runner carries
out on the device.

Rules it keeps (``check_invariants`` verifies them, tests check them independently):

* every block is either free (in its pool's free queue) or referenced, never both, and its ref
  count equals the number of block-table entries that name it (the prefix cache holds no
  reference: its blocks with count 0 are free and evictable);
* blocks are allocated on demand: ``len(table) == ceil(num_slots / block_size)``, so a sequence
  wastes at most one partly filled block;
* a block that is shared (ref count > 1) is never written: the partly filled last block is copied
  on write before a sequence appends to it;
* operations validate everything first and then commit, so one that raises leaves all state as
  it was.

The decode hot path (``append_token_ids`` then ``grow(seq, 1)`` for every running sequence) is a
dict lookup and a few int operations, with no allocation when no block is needed (``grow``
returns the shared empty tuple). Block size is a power of two so position -> (block, offset) is
a shift and a mask.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from typing import Any

from kvblocks.errors import (
    BlockLimitError,
    KVBlocksError,
    NoFreeBlocksError,
    SequenceExistsError,
    SwapError,
    SwapSpaceError,
    UnknownSequenceError,
)
from kvblocks.pool import BlockPool
from kvblocks.prefix_cache import HashFn, PrefixCache
from kvblocks.stats import KVStats
from kvblocks.table import BlockTable

__all__ = ["BlockManager", "InvariantError"]

logger = logging.getLogger(__name__)

_NO_COPY: tuple[tuple[int, int], ...] = ()


class InvariantError(KVBlocksError):
    """Raised by :meth:`BlockManager.check_invariants` when the bookkeeping is inconsistent."""


def _is_int(x: object) -> bool:
    return type(x) is int


class BlockManager:
    """Owns a GPU pool, a CPU pool and the block table of every sequence.

    Sequences are identified by ids the caller chooses (ints). See the package README for the
    operations and the invariants.
    """

    __slots__ = (
        "_cache",
        "_gpu_ref",
        "_hits",
        "_mask",
        "_queries",
        "_seqs",
        "_shift",
        "block_size",
        "cpu_pool",
        "enable_prefix_caching",
        "gpu_pool",
        "max_blocks_per_seq",
    )

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
        max_blocks_per_seq: int | None = None,
        hash_fn: HashFn | None = None,
    ) -> None:
        if not _is_int(block_size) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(
                f"block_size must be a power of two (1, 2, 4, 8, 16, 32, ...), got {block_size!r}"
            )
        if max_blocks_per_seq is not None and (
            not _is_int(max_blocks_per_seq) or max_blocks_per_seq < 1
        ):
            raise ValueError(
                f"max_blocks_per_seq must be None or an int >= 1, got {max_blocks_per_seq!r}"
            )
        if hash_fn is not None and not callable(hash_fn):
            raise ValueError(f"hash_fn must be callable, got {hash_fn!r}")
        self.block_size: int = block_size
        self.gpu_pool = BlockPool(num_gpu_blocks, block_size, device="gpu")
        self.cpu_pool = BlockPool(num_cpu_blocks, block_size, device="cpu")
        self.max_blocks_per_seq: int | None = max_blocks_per_seq
        self.enable_prefix_caching: bool = bool(enable_prefix_caching)
        self._shift = block_size.bit_length() - 1
        self._mask = block_size - 1
        self._seqs: dict[int, BlockTable] = {}
        self._gpu_ref = self.gpu_pool._ref
        self._cache: PrefixCache | None = (
            PrefixCache(self.gpu_pool, hash_fn) if enable_prefix_caching else None
        )
        self._queries = 0
        self._hits = 0

    def __repr__(self) -> str:
        return (
            f"BlockManager(block_size={self.block_size}, gpu={self.gpu_pool.num_free}/"
            f"{self.gpu_pool.num_blocks} free, cpu={self.cpu_pool.num_free}/"
            f"{self.cpu_pool.num_blocks} free, seqs={len(self._seqs)}, "
            f"prefix_caching={self.enable_prefix_caching})"
        )

    # ================================================================ helpers
    def _get(self, seq_id: int) -> BlockTable:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(
                f"unknown sequence {seq_id!r} (never allocated, or already freed); "
                "call allocate() first"
            )
        return seq

    def _get_gpu(self, seq_id: int, what: str) -> BlockTable:
        seq = self._get(seq_id)
        if not seq.on_gpu:
            raise SwapError(
                f"sequence {seq_id!r} is swapped out to the CPU; swap_in() it before {what}"
            )
        return seq

    def _check_count(self, n: object, name: str) -> None:
        if not _is_int(n) or n < 0:  # type: ignore[operator]
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")

    # ============================================================ lifecycle
    def allocate(
        self, seq_id: int, token_ids: Iterable[int], *, extra_key: Hashable | None = None
    ) -> int:
        """Register a sequence with its known token ids; return the number of cached tokens.

        With prefix caching the sequence takes the longest run of cached full blocks, at most
        ``(len(token_ids) - 1) // block_size`` of them (one token is always left to compute);
        the return value is their token count. Without, nothing is allocated and 0 is returned.
        KV slots for the rest are reserved later by :meth:`grow`.
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(
                f"sequence {seq_id!r} already exists; free() it first or use another id"
            )
        tokens = list(token_ids)
        if not tokens:
            raise ValueError(f"sequence {seq_id!r}: token_ids is empty; give at least one token")
        limit = self.max_blocks_per_seq
        if limit is not None and len(tokens) > limit * self.block_size:
            raise BlockLimitError(
                f"sequence {seq_id!r} has {len(tokens)} tokens but at most "
                f"{limit * self.block_size} fit (max_blocks_per_seq={limit} x block_size="
                f"{self.block_size}); shorten the prompt"
            )
        try:
            hash(extra_key)
        except TypeError:
            raise ValueError(f"extra_key must be hashable, got {extra_key!r}") from None
        seq = BlockTable(seq_id, [], tokens, extra_key=extra_key)
        cache = self._cache
        if cache is not None:
            max_blocks = (len(tokens) - 1) >> self._shift
            entries = cache.match(tokens, extra_key, max_blocks, seq.block_hashes)
            touch = self.gpu_pool.touch
            for e in entries:
                touch(e.block_id)
            seq.blocks = [e.block_id for e in entries]
            seq.chain = list(entries)
            seq.num_slots = len(entries) << self._shift
            self._queries += max_blocks
            self._hits += len(entries)
        self._seqs[seq_id] = seq
        return seq.num_slots

    def peek_prefix(self, token_ids: Iterable[int], *, extra_key: Hashable | None = None) -> int:
        """The cached-token count :meth:`allocate` would return now; changes nothing."""
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty; give at least one token")
        cache = self._cache
        if cache is None:
            return 0
        try:
            hash(extra_key)
        except TypeError:
            raise ValueError(f"extra_key must be hashable, got {extra_key!r}") from None
        max_blocks = (len(tokens) - 1) >> self._shift
        return len(cache.match(tokens, extra_key, max_blocks, [])) << self._shift

    def blocks_needed_for(
        self, token_ids: Iterable[int], *, extra_key: Hashable | None = None
    ) -> int:
        """Free GPU blocks that ``allocate(token_ids)`` then ``grow(len(token_ids))`` would take.

        The blocks the prompt does not find in the prefix cache, plus the cached blocks it
        would reuse that are free now (evictable: taking them lowers ``num_free`` too).
        Changes nothing. For admission decisions.
        """
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty; give at least one token")
        total = (len(tokens) + self._mask) >> self._shift
        cache = self._cache
        if cache is None:
            return total
        try:
            hash(extra_key)
        except TypeError:
            raise ValueError(f"extra_key must be hashable, got {extra_key!r}") from None
        hits = cache.match(tokens, extra_key, (len(tokens) - 1) >> self._shift, [])
        ref = self._gpu_ref
        return total - len(hits) + sum(1 for e in hits if ref[e.block_id] == 0)

    def append_token_ids(self, seq_id: int, token_ids: Iterable[int]) -> None:
        """Record newly sampled token ids (allocates no block; :meth:`grow` does)."""
        try:
            self._seqs[seq_id].token_ids += token_ids  # type: ignore[operator]
        except KeyError:
            if seq_id in self._seqs:  # the KeyError came from iterating token_ids
                raise
            self._get(seq_id)  # raises UnknownSequenceError

    def fork(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` share every block, the token ids and the slot count of the parent.

        O(blocks): one ref-count increment per block. The first one of the two to append to a
        shared partly filled block copies it (copy-on-write, see :meth:`grow`).
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise SequenceExistsError(
                f"cannot fork {parent_id!r} into {child_id!r}: sequence {child_id!r} already "
                "exists; free() it first or use another id"
            )
        ref = self._gpu_ref if parent.on_gpu else self.cpu_pool._ref
        for b in parent.blocks:
            ref[b] += 1
        parent.fast_left = 0  # its last block is shared now
        self._seqs[child_id] = BlockTable(
            child_id,
            parent.blocks.copy(),
            parent.token_ids.copy(),
            parent.num_slots,
            parent.on_gpu,
            parent.extra_key,
            parent.block_hashes.copy(),
            parent.chain.copy(),
        )

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (in whichever pool they are) and forget it.

        A block becomes free when its count reaches 0; cached blocks stay in the prefix cache,
        evictable. Blocks are released tail first, so the sequence's last blocks are evicted
        before its first ones.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            self._get(seq_id)  # raises UnknownSequenceError
        pool = self.gpu_pool if seq.on_gpu else self.cpu_pool  # type: ignore[union-attr]
        pool._decref_many(reversed(seq.blocks))  # type: ignore[union-attr]

    # ============================================================== growing
    def blocks_needed(self, seq_id: int, num_new_slots: int) -> int:
        """GPU blocks :meth:`grow` would take for ``num_new_slots`` more slots (incl. copy-on-write)."""
        seq = self._get_gpu(seq_id, "blocks_needed()")
        self._check_count(num_new_slots, "num_new_slots")
        return self._blocks_needed(seq, num_new_slots)

    def _blocks_needed(self, seq: BlockTable, n: int) -> int:
        if n == 0:
            return 0
        old = seq.num_slots
        need = ((old + n + self._mask) >> self._shift) - len(seq.blocks)
        if old & self._mask and self._gpu_ref[seq.blocks[-1]] > 1:
            need += 1
        return need

    def can_grow(self, seq_id: int, num_new_slots: int) -> bool:
        """Whether :meth:`grow` would find enough free GPU blocks and stay within
        ``max_blocks_per_seq`` (it does not check that the token ids are known)."""
        seq = self._get_gpu(seq_id, "can_grow()")
        self._check_count(num_new_slots, "num_new_slots")
        limit = self.max_blocks_per_seq
        if (
            limit is not None
            and (seq.num_slots + num_new_slots + self._mask) >> self._shift > limit
        ):
            return False
        return self._blocks_needed(seq, num_new_slots) <= self.gpu_pool._num_free

    def grow(
        self, seq_id: int, num_new_slots: int, pending: int = 0
    ) -> tuple[tuple[int, int], ...]:
        """Reserve KV slots for positions ``[num_slots, num_slots + num_new_slots)``.

        A new block only when the last one is full; if the partly filled last block is shared it
        is copied on write: the sequence gets a new block and ``((src, dst),)`` is returned for
        the runner to copy; otherwise the shared empty tuple ``()``. All or nothing.

        ``pending=1``: one slot past the known tokens may be reserved, for the token still
        being sampled (asynchronous scheduling). Only without prefix caching, which hashes a
        block's tokens when it fills.
        """
        # Fast path: the new slots fit in the partly filled last block, which this sequence
        # owns alone (``fast_left`` caches that fact, see BlockTable). No allocation.
        try:
            seq = self._seqs[seq_id]
        except KeyError:
            return self._grow(seq_id, num_new_slots)  # raises UnknownSequenceError
        if type(num_new_slots) is int and 0 < num_new_slots <= seq.fast_left:
            new = seq.num_slots + num_new_slots
            if new <= len(seq.token_ids) + (pending if self._cache is None else 0):
                seq.num_slots = new
                left = seq.fast_left - num_new_slots
                seq.fast_left = left
                if not left and self._cache is not None:  # the block just became full
                    self._cache.publish(seq, new >> self._shift)
                return _NO_COPY
        return self._grow(seq_id, num_new_slots, pending)

    def _grow(self, seq_id: int, n: int, pending: int = 0) -> tuple[tuple[int, int], ...]:
        seq = self._get_gpu(seq_id, "grow()")
        self._check_count(n, "num_new_slots")
        if pending not in (0, 1):
            raise ValueError(f"pending must be 0 or 1, got {pending!r}")
        if pending and self._cache is not None:
            raise ValueError(
                "grow(pending=...) reserves slots for unknown tokens, which prefix caching "
                "cannot hash; append_token_ids() first"
            )
        old = seq.num_slots
        new = old + n
        if new > len(seq.token_ids) + pending:
            raise ValueError(
                f"sequence {seq_id!r}: cannot reserve slots up to position {new} with only "
                f"{len(seq.token_ids)} known tokens (num_slots={old}); append_token_ids() first"
            )
        if n == 0:
            return _NO_COPY
        blocks = seq.blocks
        total = (new + self._mask) >> self._shift
        limit = self.max_blocks_per_seq
        if limit is not None and total > limit:
            raise BlockLimitError(
                f"sequence {seq_id!r} would need {total} blocks, more than max_blocks_per_seq="
                f"{limit}; stop the sequence (its maximum length is {limit * self.block_size})"
            )
        pool = self.gpu_pool
        cow = bool(old & self._mask) and self._gpu_ref[blocks[-1]] > 1
        need = total - len(blocks) + cow
        if need > pool._num_free:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {need} GPU blocks to grow by {n} slots but only "
                f"{pool._num_free} are free; preempt (swap out or free) a sequence and retry"
            )
        copies = _NO_COPY
        if cow:
            src = blocks[-1]
            dst = pool.allocate()
            self._gpu_ref[src] -= 1  # was > 1, so it stays allocated
            blocks[-1] = dst
            copies = ((src, dst),)
        allocate = pool.allocate
        for _ in range(total - len(blocks)):
            blocks.append(allocate())
        seq.num_slots = new
        r = new & self._mask
        seq.fast_left = self.block_size - r if r and self._gpu_ref[blocks[-1]] == 1 else 0
        cache = self._cache
        if cache is not None and new >> self._shift > len(seq.chain):
            cache.publish(seq, new >> self._shift)
        return copies

    # ============================================================== queries
    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        """Ids of all registered sequences, in registration order."""
        return list(self._seqs)

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table (physical ids in its current pool)."""
        return self._get(seq_id).blocks.copy()

    def block_table_ref(self, seq_id: int) -> list[int]:
        """The internal block-table list, for the hot path. Read only; it changes on grow/swap."""
        return self._get(seq_id).blocks

    def num_slots(self, seq_id: int) -> int:
        return self._get(seq_id).num_slots

    def num_tokens(self, seq_id: int) -> int:
        return len(self._get(seq_id).token_ids)

    def token_ids(self, seq_id: int) -> list[int]:
        """A copy of the sequence's token ids."""
        return self._get(seq_id).token_ids.copy()

    def location(self, seq_id: int) -> str:
        """``"gpu"`` or ``"cpu"`` (swapped out)."""
        return "gpu" if self._get(seq_id).on_gpu else "cpu"

    def num_cached_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence's leading full blocks whose content is in the prefix cache now
        (in its own blocks or in identical ones); 0 without prefix caching or while swapped out."""
        seq = self._get(seq_id)
        cache = self._cache
        n = 0
        for e in seq.chain:
            if e is None or cache is None or not cache.is_live(e):
                break
            n += 1
        return n << self._shift

    def slot(self, seq_id: int, position: int) -> int:
        """Slot of a reserved position: ``block_id * block_size + offset``."""
        seq = self._get(seq_id)
        if not _is_int(position) or not 0 <= position < seq.num_slots:
            raise ValueError(
                f"sequence {seq_id!r}: position {position!r} has no reserved slot "
                f"(reserved 0..{seq.num_slots - 1}); grow() first"
            )
        return (seq.blocks[position >> self._shift] << self._shift) | (position & self._mask)

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slots of positions ``[start, end)`` (all reserved), block by block."""
        seq = self._get(seq_id)
        if not (_is_int(start) and _is_int(end) and 0 <= start <= end <= seq.num_slots):
            raise ValueError(
                f"sequence {seq_id!r}: range [{start!r}, {end!r}) is not within the reserved "
                f"slots [0, {seq.num_slots})"
            )
        out: list[int] = []
        shift = self._shift
        blocks = seq.blocks
        pos = start
        while pos < end:
            k = pos >> shift
            base = blocks[k] << shift
            stop = min(end, (k + 1) << shift)
            off = pos & self._mask
            out.extend(range(base + off, base + off + (stop - pos)))
            pos = stop
        return out

    # ============================================================= swapping
    def _group(self, seq_ids: Iterable[int], on_gpu: bool, what: str) -> list[BlockTable]:
        ids = list(seq_ids)
        if not ids:
            raise SwapError(f"{what}: the sequence group is empty; name at least one sequence")
        if len(set(ids)) != len(ids):
            raise SwapError(f"{what}: the group {ids!r} names a sequence twice")
        seqs = [self._get(i) for i in ids]
        for seq in seqs:
            if seq.on_gpu != on_gpu:
                where = "the GPU" if seq.on_gpu else "the CPU (swapped out)"
                raise SwapError(f"{what}: sequence {seq.seq_id!r} is already on {where}")
        return seqs

    @staticmethod
    def _group_refs(seqs: list[BlockTable]) -> dict[int, int]:
        """Distinct blocks of a group -> references the group holds, in first-use order."""
        refs: dict[int, int] = {}
        for seq in seqs:
            for b in seq.blocks:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def num_group_blocks(self, seq_ids: Iterable[int]) -> int:
        """Distinct blocks held by a group: what a swap of it moves (shared blocks once)."""
        ids = list(seq_ids)
        return len(self._group_refs([self._get(i) for i in ids]))

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        """Whether the CPU pool has room for every distinct block of the group."""
        seqs = self._group(seq_ids, True, "can_swap_out()")
        return len(self._group_refs(seqs)) <= self.cpu_pool._num_free

    def can_swap_in(self, seq_ids: Iterable[int]) -> bool:
        """Whether the GPU pool has room for every distinct block of the group."""
        seqs = self._group(seq_ids, False, "can_swap_in()")
        return len(self._group_refs(seqs)) <= self.gpu_pool._num_free

    def swap_out(self, seq_ids: Iterable[int]) -> dict[int, int]:
        """Move a sequence group to the CPU pool; return the copy plan ``{gpu block: cpu block}``.

        All or nothing. A block shared inside the group moves once and stays shared; a GPU
        block also referenced by a sequence outside the group is copied and stays on the GPU
        for it.
        """
        seqs = self._group(seq_ids, True, "swap_out()")
        return self._swap(seqs, self.gpu_pool, self.cpu_pool, "swap_out()")

    def swap_in(self, seq_ids: Iterable[int]) -> dict[int, int]:
        """Move a swapped-out group back to the GPU; return ``{cpu block: gpu block}``.

        All or nothing, shared blocks move once. With prefix caching the group's full blocks are
        published again.
        """
        seqs = self._group(seq_ids, False, "swap_in()")
        mapping = self._swap(seqs, self.cpu_pool, self.gpu_pool, "swap_in()")
        cache = self._cache
        if cache is not None:
            for seq in seqs:
                cache.publish(seq, seq.num_slots >> self._shift)
        return mapping

    def _swap(
        self, seqs: list[BlockTable], src: BlockPool, dst: BlockPool, what: str
    ) -> dict[int, int]:
        refs = self._group_refs(seqs)
        if len(refs) > dst._num_free:
            raise SwapSpaceError(
                f"{what}: the group holds {len(refs)} distinct blocks but the {dst.device} pool "
                f"has only {dst._num_free} free of {dst.num_blocks}; nothing moved"
            )
        mapping: dict[int, int] = {}
        dref = dst._ref
        for b, count in refs.items():
            d = dst.allocate()
            dref[d] = count
            mapping[b] = d
        to_gpu = dst is self.gpu_pool
        for seq in seqs:
            src._decref_many(reversed(seq.blocks))
            seq.blocks = [mapping[b] for b in seq.blocks]
            seq.on_gpu = to_gpu
            seq.fast_left = 0
            seq.chain = []  # republished on swap in (block hashes stay valid)
        logger.debug("%s: %d sequences, %d blocks", what, len(seqs), len(mapping))
        return mapping

    # ========================================================= prefix cache
    def reset_prefix_cache(self) -> int:
        """Drop every cached block that no sequence uses; return how many were dropped."""
        return self._cache.reset() if self._cache is not None else 0

    # ============================================================ accounting
    def stats(self) -> KVStats:
        """Accounting snapshot (O(blocks in use))."""
        gpu, cpu = self.gpu_pool, self.cpu_pool
        bs = self.block_size
        shift, mask = self._shift, self._mask
        fills: dict[int, int] = {}
        for seq in self._seqs.values():
            if not seq.on_gpu:
                continue
            full = seq.num_slots >> shift
            blocks = seq.blocks
            for i in range(full):
                fills[blocks[i]] = bs
            rem = seq.num_slots & mask
            if rem:
                b = blocks[full]
                if fills.get(b, 0) < rem:
                    fills[b] = rem
        used = gpu.num_used
        util = sum(fills.values()) / (used * bs) if used else 1.0
        saved = sum(r - 1 for r in gpu._ref if r > 1)
        cache = self._cache
        return KVStats(
            gpu_total=gpu.num_blocks,
            gpu_free=gpu.num_free,
            gpu_used=used,
            cpu_total=cpu.num_blocks,
            cpu_free=cpu.num_free,
            cpu_used=cpu.num_used,
            kv_utilization=util,
            fragmentation=1.0 - util,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            blocks_saved_by_sharing=saved,
            gpu_usage=used / gpu.num_blocks if gpu.num_blocks else 0.0,
            num_sequences=len(self._seqs),
            prefix_cached_blocks=len(cache) if cache is not None else 0,
            prefix_cache_evictions=cache.num_evictions if cache is not None else 0,
        )

    # ============================================================ debugging
    def debug_snapshot(self) -> dict[str, Any]:
        """A deep, comparable copy of all state (pools, free queues, tables, cache, counters).

        Tests compare snapshots taken before and after a failing call to prove it changed
        nothing.
        """

        def pool_state(p: BlockPool) -> tuple[Any, ...]:
            return (p.num_free, tuple(p._ref), tuple(p._cached), tuple(p.free_block_ids()))

        cache = self._cache
        return {
            "gpu": pool_state(self.gpu_pool),
            "cpu": pool_state(self.cpu_pool),
            "seqs": [
                (
                    s.seq_id,
                    tuple(s.blocks),
                    tuple(s.token_ids),
                    s.num_slots,
                    s.on_gpu,
                    s.extra_key,
                    tuple(s.block_hashes),
                    tuple(None if e is None else e.serial for e in s.chain),
                )
                for s in self._seqs.values()
            ],
            "cache": None
            if cache is None
            else (
                tuple(
                    (e.serial, e.block_hash, e.parent_serial, e.token_ids, e.extra_key, e.block_id)
                    for e in cache.entries()
                ),
                cache._next_serial,
                cache.num_evictions,
                cache.num_refused,
            ),
            "counters": (self._queries, self._hits),
        }

    def check_invariants(self) -> None:
        """Verify the bookkeeping from scratch (O(all blocks)); raise :class:`InvariantError`.

        Meant for tests (also other packages' tests) and debugging, not for the hot path.
        """
        problems: list[str] = []
        expected = {True: [0] * self.gpu_pool.num_blocks, False: [0] * self.cpu_pool.num_blocks}
        for seq in self._seqs.values():
            exp_blocks = (seq.num_slots + self._mask) >> self._shift
            if len(seq.blocks) != exp_blocks:
                problems.append(
                    f"seq {seq.seq_id!r}: {len(seq.blocks)} blocks for {seq.num_slots} slots"
                )
            # without prefix caching, one slot may wait for a token being sampled (grow pending)
            if seq.num_slots > len(seq.token_ids) + (self._cache is None):
                problems.append(f"seq {seq.seq_id!r}: more slots than tokens")
            if seq.fast_left and not (
                seq.on_gpu
                and seq.num_slots & self._mask
                and seq.fast_left == self.block_size - (seq.num_slots & self._mask)
                and self._gpu_ref[seq.blocks[-1]] == 1
            ):
                problems.append(f"seq {seq.seq_id!r}: stale fast_left={seq.fast_left}")
            for b in seq.blocks:
                expected[seq.on_gpu][b] += 1
        for on_gpu, pool in ((True, self.gpu_pool), (False, self.cpu_pool)):
            free = pool.free_block_ids()
            if len(free) != len(set(free)) or len(free) != pool.num_free:
                problems.append(
                    f"{pool.device}: free queue has {len(free)} entries, num_free={pool.num_free}"
                )
            fset = set(free)
            for b in range(pool.num_blocks):
                if pool._ref[b] != expected[on_gpu][b]:
                    problems.append(
                        f"{pool.device} block {b}: ref count {pool._ref[b]} but "
                        f"{expected[on_gpu][b]} table references"
                    )
                if (pool._ref[b] == 0) != (b in fset):
                    problems.append(f"{pool.device} block {b}: free/referenced mismatch")
            if pool.num_free + pool.num_used != pool.num_blocks:
                problems.append(f"{pool.device}: free + used != total")
        cache = self._cache
        if cache is not None:
            for e in cache.entries():
                if (
                    cache.entry_of_block(e.block_id) is not e
                    or not self.gpu_pool._cached[e.block_id]
                ):
                    problems.append(f"cache entry {e.serial}: block {e.block_id} not marked")
        if problems:
            raise InvariantError("; ".join(problems[:10]))
