"""BlockPool: the physical blocks of one device, their ref counts and the free queue.

Why this shape: the block manager allocates and frees blocks on every decode step for hundreds of
sequences, so every pool operation must be O(1) and allocate nothing. The free queue is a doubly
linked list threaded through two preallocated int lists (``_prev`` / ``_next``, indexed by block
id, with one sentinel slot at index ``num_blocks``) in the manner of vLLM V1: popping the head,
pushing at either end and unlinking a block from the middle (a prefix-cache hit on an evictable
block) are a handful of list stores.

Order of the queue, which is the eviction policy:

* a block that reaches ref count 0 and holds nothing worth keeping goes to the **head**, so it is
  reused first;
* a block that is in the prefix cache (marked with :meth:`BlockPool.set_cached`) goes to the
  **tail**: it stays reusable until memory is needed, and the head-most cached block is the least
  recently freed, so cached blocks are evicted least recently used first. When such a block is
  popped for reuse the pool calls its ``on_evict`` hook so the prefix cache forgets it.

``num_free`` therefore counts cached blocks with ref count 0 too: they are evictable. The prefix
cache holds no reference of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvblocks.errors import DoubleFreeError, InvalidBlockError, NoFreeBlocksError

__all__ = ["BlockPool"]


class BlockPool:
    """Physical KV blocks ``0..num_blocks-1`` of one device kind ("gpu" or "cpu").

    The pool counts blocks and references only; how many token slots a block holds is the
    block manager's ``block_size`` (a pool never needs it).

    Invariants: a block is in the free queue exactly when its ref count is 0;
    ``num_free + num_used == num_blocks``.
    """

    __slots__ = (
        "_cached",
        "_next",
        "_num_free",
        "_prev",
        "_ref",
        "_sentinel",
        "device",
        "num_blocks",
        "on_evict",
    )

    def __init__(self, num_blocks: int, *, device: str = "gpu") -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.num_blocks: int = num_blocks
        self.device: str = device
        #: Called with a block id when a cached free block is taken for reuse (evicted).
        self.on_evict: Callable[[int], None] | None = None
        s = num_blocks  # sentinel index: _next[s] is the head, _prev[s] the tail
        self._sentinel = s
        # Initially every block is free, in id order: 0 is allocated first.
        self._next: list[int] = [*range(1, num_blocks + 1), 0]
        self._prev: list[int] = [s, *range(num_blocks)]
        self._ref: list[int] = [0] * num_blocks
        self._cached: list[bool] = [False] * num_blocks
        self._num_free = num_blocks

    def __repr__(self) -> str:
        return (
            f"BlockPool(device={self.device!r}, num_blocks={self.num_blocks}, "
            f"num_free={self._num_free})"
        )

    # ----------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        """Free blocks, including cached blocks with ref count 0 (evictable)."""
        return self._num_free

    @property
    def num_used(self) -> int:
        """Blocks with ref count >= 1."""
        return self.num_blocks - self._num_free

    def ref_count(self, block_id: int) -> int:
        """References held on ``block_id`` (0 when it is free)."""
        self._check(block_id)
        return self._ref[block_id]

    def is_free(self, block_id: int) -> bool:
        """Whether ``block_id`` sits in the free queue (ref count 0)."""
        self._check(block_id)
        return self._ref[block_id] == 0

    # ---------------------------------------------------------- allocate/free
    def allocate(self) -> int:
        """Take the block at the head of the free queue; its ref count becomes 1.

        Raises :class:`NoFreeBlocksError` (nothing changes) when no block is free.
        """
        nxt = self._next
        s = self._sentinel
        b = nxt[s]
        if b == s:
            raise NoFreeBlocksError(
                f"no free {self.device} block (all {self.num_blocks} in use); "
                "free or preempt a sequence and retry"
            )
        n = nxt[b]
        nxt[s] = n
        self._prev[n] = s
        self._ref[b] = 1
        self._num_free -= 1
        if self._cached[b]:
            self._cached[b] = False
            if self.on_evict is not None:
                self.on_evict(b)
        return b

    def allocate_n(self, n: int) -> list[int]:
        """Allocate ``n`` blocks, all or nothing (:class:`NoFreeBlocksError` leaves state as is)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate_n needs an int n >= 0, got {n!r}")
        if n > self._num_free:
            raise NoFreeBlocksError(
                f"{n} {self.device} blocks needed but only {self._num_free} of "
                f"{self.num_blocks} are free; free or preempt a sequence and retry"
            )
        alloc = self.allocate
        return [alloc() for _ in range(n)]

    def incref(self, block_id: int) -> None:
        """Add a reference to an allocated block (sharing it).

        A free block cannot be incref'd (that would be a use after free); to take a block back
        from the free queue (a prefix-cache hit) use :meth:`touch`.
        """
        self._check(block_id)
        if self._ref[block_id] == 0:
            raise InvalidBlockError(
                f"{self.device} block {block_id} is free; incref needs an allocated block "
                "(use touch() to reclaim a cached free block)"
            )
        self._ref[block_id] += 1

    def touch(self, block_id: int) -> None:
        """Add a reference; a free block is first unlinked from the free queue (O(1)).

        This is how a prefix-cache hit reclaims an evictable cached block. The block keeps
        its cached mark.
        """
        self._check(block_id)
        ref = self._ref
        if ref[block_id] == 0:
            self._unlink(block_id)
            self._num_free -= 1
        ref[block_id] += 1

    def decref(self, block_id: int) -> None:
        """Drop one reference; at 0 the block returns to the free queue.

        Cached blocks go to the tail (kept for reuse, evicted least recently used first), other
        blocks to the head (reused first). :class:`DoubleFreeError` for a block already free.
        """
        self._check(block_id)
        ref = self._ref
        c = ref[block_id]
        if c == 0:
            raise DoubleFreeError(
                f"{self.device} block {block_id} is already free (ref count 0); "
                "a block must be released once per reference"
            )
        ref[block_id] = c - 1
        if c == 1:
            self._release(block_id)

    def set_cached(self, block_id: int, cached: bool) -> None:
        """Mark a block as holding prefix-cache content (or clear the mark).

        The mark decides where the block goes when it is freed, and whether ``on_evict`` runs
        when it is reused. A free block keeps its place in the queue.
        """
        self._check(block_id)
        self._cached[block_id] = bool(cached)

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` carries the prefix-cache mark."""
        self._check(block_id)
        return self._cached[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue from head (next to be allocated) to tail. O(num_free); for tests/debug."""
        out: list[int] = []
        nxt = self._next
        s = self._sentinel
        b = nxt[s]
        while b != s:
            out.append(b)
            b = nxt[b]
        return out

    # --------------------------------------------------------------- internals
    def _check(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise InvalidBlockError(f"block ids are ints, got {block_id!r}")
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(
                f"{self.device} block id {block_id} is out of range 0..{self.num_blocks - 1}"
            )

    def _unlink(self, b: int) -> None:
        nxt = self._next
        prv = self._prev
        p = prv[b]
        n = nxt[b]
        nxt[p] = n
        prv[n] = p

    def _release(self, b: int) -> None:
        """Put a block whose count just reached 0 back into the free queue."""
        nxt = self._next
        prv = self._prev
        s = self._sentinel
        if self._cached[b]:  # tail: keep it as long as possible
            t = prv[s]
            nxt[t] = b
            prv[b] = t
            nxt[b] = s
            prv[s] = b
        else:  # head: reuse it first
            h = nxt[s]
            prv[h] = b
            nxt[b] = h
            prv[b] = s
            nxt[s] = b
        self._num_free += 1

    def _decref_many(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block, in order (trusted caller: ids valid and allocated)."""
        ref = self._ref
        release = self._release
        for b in blocks:
            c = ref[b]
            ref[b] = c - 1
            if c == 1:
                release(b)
