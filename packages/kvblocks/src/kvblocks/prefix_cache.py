"""Prefix cache: find full KV blocks another sequence already computed, by a hash chain.

Why a hash chain: the KV of a block depends on every token before it, not only on its own
tokens, so a full block is identified by ``hash_fn(parent block hash, block token ids,
extra_key)``; equal chains mean equal prefixes, and a lookup walks a prompt block by block and
stops at the first miss (the longest run of cached full blocks).

Why a hash is never trusted alone: hashes collide (tests inject a constant ``hash_fn``). Each
entry keeps its parent hash, its token ids and its extra key, and also the *serial number* of its
parent entry (serials are never reused). A lookup accepts an entry only when all of them match
what it is looking for, so by induction a matched run is exactly the prompt's prefix; comparing
the parent hash alone would not do when every hash is equal. Inserting a block under a hash that
already belongs to different content is refused (that block simply stays uncached), so a
collision costs a cache miss, never a wrong block. (An entry whose parent entry was evicted can
never be matched again; it gives its hash up to a live chain instead of blocking it.)

Why the cache holds no reference: a cached block whose ref count drops to 0 sits in the pool's
free queue (at the tail) and still counts as free. It is reused only when memory is needed
(the uncached free blocks go first), least recently freed first; when the pool hands it out
again it calls :meth:`PrefixCache.evict`, which forgets the entry. A hit on such a block
unlinks it from the free queue in O(1) (:meth:`BlockPool.touch`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from kvblocks.cache_entry import CacheEntry
from kvblocks.pool import BlockPool
from kvblocks.table import BlockTable

__all__ = ["HashFn", "PrefixCache", "default_hash_fn"]

#: ``hash_fn(parent_hash, block_token_ids, extra_key) -> hashable``; ``parent_hash`` is None for
#: the first block of a sequence and ``block_token_ids`` a tuple of ``block_size`` ints.
HashFn = Callable[[Hashable | None, tuple[int, ...], Hashable | None], Hashable]


def default_hash_fn(
    parent_hash: Hashable | None, token_ids: tuple[int, ...], extra_key: Hashable | None
) -> int:
    """Python's built-in hash of the triple: fast; collisions are handled by the cache.

    Stable within one process (enough: the cache lives in one process). String extra keys hash
    differently in different processes (PYTHONHASHSEED), which does not matter here.
    """
    return hash((parent_hash, token_ids, extra_key))


class PrefixCache:
    """Map from block-hash chain to GPU blocks of one pool (see the module docstring)."""

    __slots__ = (
        "_bs",
        "_by_block",
        "_by_hash",
        "_hash_fn",
        "_next_serial",
        "_pool",
        "num_evictions",
        "num_refused",
    )

    def __init__(self, pool: BlockPool, block_size: int, hash_fn: HashFn | None = None) -> None:
        self._pool = pool
        self._bs = block_size  # validated by the BlockManager that owns this cache
        self._hash_fn: HashFn = hash_fn if hash_fn is not None else default_hash_fn
        self._by_hash: dict[Hashable, CacheEntry] = {}
        self._by_block: list[CacheEntry | None] = [None] * pool.num_blocks
        self._next_serial = 0
        #: Cached blocks handed out again by the pool (their entries were dropped).
        self.num_evictions = 0
        #: Inserts refused because a different block content had the same hash.
        self.num_refused = 0
        pool.on_evict = self.evict

    def __len__(self) -> int:
        return len(self._by_hash)

    def entry_of_block(self, block_id: int) -> CacheEntry | None:
        """The entry whose content lives in ``block_id``, if any."""
        return self._by_block[block_id]

    def entries(self) -> list[CacheEntry]:
        """All entries, oldest insert first (for tests and debugging)."""
        return list(self._by_hash.values())

    def match(
        self,
        token_ids: Sequence[int],
        extra_key: Hashable | None,
        max_blocks: int,
        hashes: list[Hashable],
    ) -> list[CacheEntry]:
        """Longest run of cached full blocks that is a prefix of ``token_ids``.

        Looks at most ``max_blocks`` blocks. ``hashes`` holds the chain hashes already known
        for these tokens; the ones computed here are appended to it (the caller keeps them so
        a later publish does not hash again). Changes nothing else.
        """
        bs = self._bs
        by_hash = self._by_hash
        hash_fn = self._hash_fn
        matched: list[CacheEntry] = []
        parent_hash: Hashable | None = None
        parent_serial = -1
        start = 0
        for k in range(max_blocks):
            toks = tuple(token_ids[start : start + bs])
            start += bs
            if k < len(hashes):
                h = hashes[k]
            else:
                h = hash_fn(parent_hash, toks, extra_key)
                hashes.append(h)
            e = by_hash.get(h)
            if (
                e is None
                or e.parent_serial != parent_serial
                or e.token_ids != toks
                or e.extra_key != extra_key
                or e.parent_hash != parent_hash
            ):
                break
            matched.append(e)
            parent_hash = h
            parent_serial = e.serial
        return matched

    def publish(self, seq: BlockTable, upto: int) -> None:
        """Record the full blocks ``len(seq.chain)..upto-1`` of a GPU sequence.

        A block whose content is already cached in another block is not inserted (the chain
        follows the existing entry); a block whose hash belongs to different content is refused
        and ends the chain (later blocks cannot be found by a lookup anyway).
        """
        bs = self._bs
        by_hash = self._by_hash
        by_block = self._by_block
        chain = seq.chain
        hashes = seq.block_hashes
        token_ids = seq.token_ids
        blocks = seq.blocks
        extra_key = seq.extra_key
        for k in range(len(chain), upto):
            if k:
                parent = chain[k - 1]
                if parent is None or by_block[parent.block_id] is not parent:
                    # Chain broken (refused collision) or its parent entry was evicted.
                    chain.append(None)
                    continue
                parent_serial = parent.serial
                parent_hash = hashes[k - 1]
            else:
                parent_serial = -1
                parent_hash = None
            toks = tuple(token_ids[k * bs : k * bs + bs])
            if k < len(hashes):
                h = hashes[k]
            else:
                h = self._hash_fn(parent_hash, toks, extra_key)
                hashes.append(h)
            b = blocks[k]
            own = by_block[b]
            if own is not None:  # this very block is cached already (shared with a sibling)
                chain.append(own)
                continue
            e = by_hash.get(h)
            if e is not None:
                if (
                    e.parent_serial == parent_serial
                    and e.token_ids == toks
                    and e.extra_key == extra_key
                    and e.parent_hash == parent_hash
                ):
                    chain.append(e)  # same content already cached in another block
                    continue
                if not self._is_stale(e):
                    self.num_refused += 1
                    chain.append(None)
                    continue
                self._drop(e)  # unreachable anyway: let the live chain have the hash
            e = CacheEntry(self._next_serial, h, parent_hash, parent_serial, toks, extra_key, b)
            self._next_serial += 1
            by_hash[h] = e
            by_block[b] = e
            self._pool._cached[b] = True
            chain.append(e)

    def is_live(self, e: CacheEntry) -> bool:
        """Whether ``e`` is still in the cache (not evicted or dropped)."""
        return self._by_block[e.block_id] is e

    def _is_stale(self, e: CacheEntry) -> bool:
        """An entry whose parent entry is gone can never be matched again."""
        if e.parent_serial < 0:
            return False
        p = self._by_hash.get(e.parent_hash)
        return p is None or p.serial != e.parent_serial

    def _drop(self, e: CacheEntry) -> None:
        """Forget an entry; a free block moves to the head of the queue (uncached region)."""
        b = e.block_id
        pool = self._pool
        del self._by_hash[e.block_hash]
        self._by_block[b] = None
        pool._cached[b] = False
        if pool._ref[b] == 0:
            pool._unlink(b)
            pool._num_free -= 1
            pool._release(b)

    def evict(self, block_id: int) -> None:
        """Forget the entry of ``block_id`` (the pool is handing the block out again)."""
        e = self._by_block[block_id]
        if e is None:
            return
        self._by_block[block_id] = None
        del self._by_hash[e.block_hash]
        self.num_evictions += 1

    def reset(self) -> int:
        """Forget every entry whose block is free; return how many were dropped.

        Entries of blocks in use stay (their sequences rely on them). The dropped blocks move
        to the head of the free queue, where uncached free blocks belong.
        """
        pool = self._pool
        dropped = 0
        for e in list(self._by_hash.values()):
            if pool._ref[e.block_id] == 0:
                self._drop(e)
                dropped += 1
        return dropped
