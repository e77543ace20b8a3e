"""BlockManager: block tables of all sequences over a GPU pool and a CPU (swap) pool.

Why it exists: PagedAttention lets each sequence see contiguous logical blocks while its KV lives
in physical blocks scattered over memory. This module decides which physical block backs which
logical block, and nothing else: it speaks in ints (sequence ids, block ids, slots), never
touches tensors, and returns plans (copy-on-write pairs, swap maps) that the model runner carries
out on the device. It owns all block arithmetic: a caller (the scheduler) asks it how many blocks
an operation needs (:meth:`BlockManager.blocks_needed` and friends) and how many are free
(:attr:`BlockManager.num_free_blocks`), and never counts blocks itself.

Rules it keeps (``check_invariants`` verifies them, tests check them independently):

* every block is either free (in its pool's free queue) or referenced, never both, and its ref
  count equals the number of block-table entries that name it (the prefix cache holds no
  reference: its blocks with count 0 are free and evictable);
* blocks are allocated on demand: ``len(table) == ceil(num_slots / block_size)``, so a sequence
  wastes at most one partly filled block;
* a block that is shared (ref count > 1) is never written: the partly filled last block is copied
  on write before a sequence appends to it;
* operations validate everything first and then commit, so one that raises (or
  :meth:`BlockManager.allocate_slots` returning None) leaves all state as it was.

Tokens are stored once, by their owner: :meth:`BlockManager.allocate` keeps a reference to the
caller's live token list, which the caller appends to; the manager only reads it.

The decode hot path (the caller appends the sampled token to its list, then
``allocate_slots(seq, 1)`` for every running sequence) is a dict lookup and a few int
operations, with no allocation when no block is needed (it returns the shared empty tuple).
Block size is a power of two so position -> (block, offset) is a shift and a mask.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from kvblocks.errors import (
    BlockLimitError,
    KVBlocksError,
    SequenceExistsError,
    SwapError,
    SwapSpaceError,
    UnknownSequenceError,
)
from kvblocks.layout import check_block_size, slot_of
from kvblocks.pool import BlockPool
from kvblocks.prefix_cache import HashFn, PrefixCache
from kvblocks.stats import KVStats
from kvblocks.table import BlockTable

__all__ = ["BlockManager", "InvariantError"]

logger = logging.getLogger(__name__)

#: What :meth:`BlockManager.allocate_slots` returns when nothing has to be copied (shared, so the
#: hot path allocates nothing).
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
        """Create empty pools of ``num_gpu_blocks`` and ``num_cpu_blocks`` blocks.

        ``block_size`` (tokens per block, a power of two, checked by
        :func:`kvblocks.check_block_size`) is read by everyone from :attr:`block_size`.
        ``max_blocks_per_seq`` caps one sequence's block table (None: no cap). ``hash_fn``
        replaces the prefix cache's block hash (tests inject colliding ones).
        """
        check_block_size(block_size)
        if max_blocks_per_seq is not None and (
            not _is_int(max_blocks_per_seq) or max_blocks_per_seq < 1
        ):
            raise ValueError(
                f"max_blocks_per_seq must be None or an int >= 1, got {max_blocks_per_seq!r}"
            )
        if hash_fn is not None and not callable(hash_fn):
            raise ValueError(f"hash_fn must be callable, got {hash_fn!r}")
        #: Tokens per block: the one place the block size is stored (everyone reads it here).
        self.block_size: int = block_size
        self.gpu_pool = BlockPool(num_gpu_blocks, device="gpu")
        self.cpu_pool = BlockPool(num_cpu_blocks, device="cpu")
        self.max_blocks_per_seq: int | None = max_blocks_per_seq
        self.enable_prefix_caching: bool = bool(enable_prefix_caching)
        self._shift = block_size.bit_length() - 1
        self._mask = block_size - 1
        self._seqs: dict[int, BlockTable] = {}
        self._gpu_ref = self.gpu_pool._ref
        self._cache: PrefixCache | None = (
            PrefixCache(self.gpu_pool, block_size, hash_fn) if enable_prefix_caching else None
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

    def _check_extra_key(self, extra_key: object) -> None:
        try:
            hash(extra_key)
        except TypeError:
            raise ValueError(f"extra_key must be hashable, got {extra_key!r}") from None

    def _counts(self, num_new_tokens: Iterable[int], n_seqs: int, what: str) -> list[int]:
        ns = list(num_new_tokens)
        if len(ns) != n_seqs:
            raise ValueError(
                f"{what}: {len(ns)} token counts for {n_seqs} sequences; give one per sequence"
            )
        for n in ns:
            self._check_count(n, "num_new_tokens")
        return ns

    def _distinct(self, seq_ids: Iterable[int], what: str) -> list[int]:
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what}: the group {ids!r} names a sequence twice")
        return ids

    # ============================================================ lifecycle
    def allocate(
        self, seq_id: int, token_ids: list[int], *, extra_key: Hashable | None = None
    ) -> int:
        """Register a sequence with its live token list; return the number of cached tokens.

        ``token_ids`` is the caller's own list of the sequence's known tokens (prompt, then
        generated ones). The manager keeps a *reference* to it and never changes it: the caller
        owns it and appends each new token to it (before reserving that token's slot with
        :meth:`allocate_slots`), so every token is stored once. Never reorder or shrink it.

        With prefix caching the sequence takes the longest run of cached full blocks, at most
        ``(len(token_ids) - 1) // block_size`` of them (one token is always left to compute);
        the return value is their token count. Without, nothing is allocated and 0 is returned.
        KV slots for the rest are reserved later by :meth:`allocate_slots`.
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(
                f"sequence {seq_id!r} already exists; free() it first or use another id"
            )
        if not isinstance(token_ids, list):
            raise ValueError(
                f"sequence {seq_id!r}: token_ids must be a list that you own and append to "
                f"(the manager keeps a reference to it), got {type(token_ids).__name__}; "
                "pass list(...)"
            )
        tokens = token_ids
        if not tokens:
            raise ValueError(f"sequence {seq_id!r}: token_ids is empty; give at least one token")
        limit = self.max_blocks_per_seq
        if limit is not None and len(tokens) > limit * self.block_size:
            raise BlockLimitError(
                f"sequence {seq_id!r} has {len(tokens)} tokens but at most "
                f"{limit * self.block_size} fit (max_blocks_per_seq={limit} x block_size="
                f"{self.block_size}); shorten the prompt"
            )
        self._check_extra_key(extra_key)
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

    def fork(self, parent_id: int, child_id: int, token_ids: list[int]) -> None:
        """Make ``child_id`` share every block and the slot count of the parent.

        ``token_ids`` is the child's own live token list (the caller's copy of the parent's
        list, e.g. ``parent_tokens.copy()``), which the manager keeps by reference as in
        :meth:`allocate`; it must equal the parent's tokens at the fork, since the two share the
        KV of all of them. Append each sequence's own next token after the fork.

        O(blocks): one ref-count increment per block. The first one of the two to write into a
        shared partly filled block copies it (copy-on-write, see :meth:`allocate_slots`).
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise SequenceExistsError(
                f"cannot fork {parent_id!r} into {child_id!r}: sequence {child_id!r} already "
                "exists; free() it first or use another id"
            )
        if not isinstance(token_ids, list) or token_ids is parent.token_ids:
            raise ValueError(
                f"fork({parent_id!r}, {child_id!r}): token_ids must be the child's own new list "
                "(a copy of the parent's, e.g. parent_tokens.copy()), not the parent's list or "
                f"a {type(token_ids).__name__}"
            )
        if token_ids != parent.token_ids:
            raise ValueError(
                f"fork({parent_id!r}, {child_id!r}): the child's token_ids must equal the "
                f"parent's {len(parent.token_ids)} tokens at the fork (they share their KV); "
                "append the child's own tokens after fork()"
            )
        ref = self._gpu_ref if parent.on_gpu else self.cpu_pool._ref
        for b in parent.blocks:
            ref[b] += 1
        parent.fast_left = 0  # its last block is shared now
        self._seqs[child_id] = BlockTable(
            child_id,
            parent.blocks.copy(),
            token_ids,
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
        before its first ones. The caller's token list is left as it is.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            self._get(seq_id)  # raises UnknownSequenceError
        pool = self.gpu_pool if seq.on_gpu else self.cpu_pool  # type: ignore[union-attr]
        pool._decref_many(reversed(seq.blocks))  # type: ignore[union-attr]

    # ========================================================= asking first
    @property
    def num_free_blocks(self) -> int:
        """Free GPU blocks now, evictable prefix-cache blocks included.

        What the blocks_needed* answers are compared with; a scheduler reads this instead of
        looking into the pool.
        """
        return self.gpu_pool._num_free

    def peek_prefix(self, token_ids: Iterable[int], *, extra_key: Hashable | None = None) -> int:
        """The cached-token count :meth:`allocate` would return now; changes nothing.

        Lets a scheduler plan a new prompt's first chunk (the tokens past its cached prefix)
        before deciding to admit it.
        """
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        if not tokens:
            raise ValueError("token_ids is empty; give at least one token")
        cache = self._cache
        if cache is None:
            return 0
        self._check_extra_key(extra_key)
        max_blocks = (len(tokens) - 1) >> self._shift
        return len(cache.match(tokens, extra_key, max_blocks, [])) << self._shift

    def blocks_needed_to_admit(
        self,
        token_lists: Sequence[Sequence[int]],
        num_new_tokens: Iterable[int] | None = None,
        *,
        extra_key: Hashable | None = None,
    ) -> int:
        """Free GPU blocks that admitting new sequences would take; changes nothing.

        That is: :meth:`allocate` of each token list (the sequences of one request, which
        share ``extra_key``), then :meth:`allocate_slots` of ``num_new_tokens[i]`` slots past
        each one's cached prefix (default: all its remaining tokens). Counts the new blocks
        plus the cached blocks the prompts would reuse that are free now (evictable: taking them
        lowers :attr:`num_free_blocks` too), each such block once even when several sequences
        hit it. For admission decisions (with a watermark, or "never fits" when nothing runs).
        """
        lists = [t if isinstance(t, list) else list(t) for t in token_lists]
        if num_new_tokens is not None:
            ns: list[int] | None = self._counts(
                num_new_tokens, len(lists), "blocks_needed_to_admit()"
            )
        else:
            ns = None
        cache = self._cache
        if cache is not None:
            self._check_extra_key(extra_key)
        shift, mask, ref = self._shift, self._mask, self._gpu_ref
        evictable: set[int] = set()
        need = 0
        for i, tokens in enumerate(lists):
            if not tokens:
                raise ValueError("token_ids is empty; give at least one token")
            cached = 0
            if cache is not None:
                hits = cache.match(tokens, extra_key, (len(tokens) - 1) >> shift, [])
                cached = len(hits) << shift
                evictable.update(e.block_id for e in hits if ref[e.block_id] == 0)
            n = len(tokens) - cached if ns is None else ns[i]
            if cached + n > len(tokens):
                raise ValueError(
                    f"blocks_needed_to_admit(): {n} new tokens past {cached} cached ones exceed "
                    f"the {len(tokens)} known tokens of sequence {i}"
                )
            need += ((cached + n + mask) >> shift) - (cached >> shift)
        return need + len(evictable)

    def blocks_needed_for(
        self, token_ids: Iterable[int], *, extra_key: Hashable | None = None
    ) -> int:
        """Free GPU blocks that ``allocate(token_ids)`` then reserving slots for all of its
        tokens would take (cache hits on evictable blocks included); changes nothing.

        The one-prompt, whole-prompt case of :meth:`blocks_needed_to_admit`.
        """
        return self.blocks_needed_to_admit([token_ids], extra_key=extra_key)

    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """GPU blocks that :meth:`allocate_slots` would take for ``num_new_tokens`` more slots
        of a sequence on the GPU (new blocks, plus one when its shared partly filled last block
        must be copied on write)."""
        seq = self._get_gpu(seq_id, "blocks_needed()")
        self._check_count(num_new_tokens, "num_new_tokens")
        return self._blocks_needed(seq, num_new_tokens)

    def _blocks_needed(self, seq: BlockTable, n: int) -> int:
        if n == 0:
            return 0
        old = seq.num_slots
        need = ((old + n + self._mask) >> self._shift) - len(seq.blocks)
        if old & self._mask and self._gpu_ref[seq.blocks[-1]] > 1:
            need += 1
        return need

    def group_blocks_needed(self, seq_ids: Iterable[int], num_new_tokens: Iterable[int]) -> int:
        """Exact GPU blocks that growing several sequences of one group takes, each
        ``seq_id[i]`` by ``num_new_tokens[i]`` slots, in any order; changes nothing.

        Differs from the sum of :meth:`blocks_needed` when siblings (forks: parallel samples,
        beams) share a partly filled last block that nobody else references: every one of them
        but the last to grow copies it on write, the last one writes in place. So the group's
        sequences must be grown one after the other, all of them, right after asking.
        """
        ids = self._distinct(seq_ids, "group_blocks_needed()")
        seqs = [self._get_gpu(i, "group_blocks_needed()") for i in ids]
        ns = self._counts(num_new_tokens, len(seqs), "group_blocks_needed()")
        mask = self._mask
        need = 0
        shared: dict[int, int] = {}  # partly filled last block -> sequences growing into it
        for seq, n in zip(seqs, ns):
            if n:
                need += self._blocks_needed(seq, n)
                if seq.num_slots & mask:
                    b = seq.blocks[-1]
                    shared[b] = shared.get(b, 0) + 1
        ref = self._gpu_ref
        for b, k in shared.items():
            if k > 1 and ref[b] == k:
                need -= 1
        return need

    def blocks_needed_to_swap_in(
        self, seq_ids: Iterable[int], num_new_tokens: Iterable[int]
    ) -> int:
        """An upper bound of the GPU blocks that swapping a group in and then growing each
        ``seq_ids[i]`` by ``num_new_tokens[i]`` slots takes; changes nothing.

        The group's distinct blocks (what :meth:`swap_in` moves, shared blocks once), plus per
        sequence its new blocks and one more when its last block is partly filled (it may be
        shared after the swap and need a copy-on-write). Lets a scheduler keep a watermark of
        free blocks before it moves anything.
        """
        seqs = self._group(seq_ids, False, "blocks_needed_to_swap_in()")
        ns = self._counts(num_new_tokens, len(seqs), "blocks_needed_to_swap_in()")
        shift, mask = self._shift, self._mask
        need = len(self._group_refs(seqs))
        for seq, n in zip(seqs, ns):
            c = seq.num_slots
            need += ((c + n + mask) >> shift) - ((c + mask) >> shift) + (1 if c & mask else 0)
        return need

    # ======================================================== reserving slots
    def allocate_slots(
        self, seq_id: int, num_new_tokens: int, pending: int = 0
    ) -> tuple[tuple[int, int], ...] | None:
        """Reserve KV slots for the sequence's next ``num_new_tokens`` positions,
        ``[num_slots, num_slots + num_new_tokens)``; return the copy-on-write pairs, or None.

        A new block only when the last one is full. If the partly filled last block is shared
        it is copied on write: the sequence gets a new block and ``((src, dst),)`` is returned
        for the runner to copy; otherwise the shared empty tuple ``()``. **None when the GPU
        pool has too few free blocks; then nothing changed**: the caller frees memory (preempts
        a sequence) and asks again. All or nothing.

        The positions must hold known tokens (the caller appended them to its list first).
        ``pending=1``: one position past the known tokens may be reserved, for the token still
        being sampled (asynchronous scheduling). Only without prefix caching, which hashes a
        block's tokens when it fills. Raises (changing nothing) for an unknown or swapped-out
        sequence, a bad count, slots past the known tokens, or more than
        ``max_blocks_per_seq`` blocks.
        """
        # Fast path: the new slots fit in the partly filled last block, which this sequence
        # owns alone (``fast_left`` caches that fact, see BlockTable). No allocation.
        try:
            seq = self._seqs[seq_id]
        except KeyError:
            return self._allocate_slots(seq_id, num_new_tokens, pending)  # raises
        if type(num_new_tokens) is int and 0 < num_new_tokens <= seq.fast_left:
            new = seq.num_slots + num_new_tokens
            known = len(seq.token_ids)
            if new <= known or (pending == 1 and new == known + 1 and self._cache is None):
                seq.num_slots = new
                left = seq.fast_left - num_new_tokens
                seq.fast_left = left
                if not left and self._cache is not None:  # the block just became full
                    self._cache.publish(seq, new >> self._shift)
                return _NO_COPY
        return self._allocate_slots(seq_id, num_new_tokens, pending)

    def _allocate_slots(
        self, seq_id: int, n: int, pending: int
    ) -> tuple[tuple[int, int], ...] | None:
        seq = self._get_gpu(seq_id, "allocate_slots()")
        self._check_count(n, "num_new_tokens")
        if pending not in (0, 1) or type(pending) is not int:
            raise ValueError(f"pending must be 0 or 1, got {pending!r}")
        if pending and self._cache is not None:
            raise ValueError(
                "allocate_slots(pending=1) reserves a slot for a token not known yet, which "
                "prefix caching cannot hash; append the token to the list first"
            )
        old = seq.num_slots
        new = old + n
        if new > len(seq.token_ids) + pending:
            raise ValueError(
                f"sequence {seq_id!r}: cannot reserve slots up to position {new} with only "
                f"{len(seq.token_ids)} known tokens (num_slots={old}); append the tokens to "
                "the sequence's token list first"
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
        if total - len(blocks) + cow > pool._num_free:
            return None
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
        """Whether ``seq_id`` is registered (allocated and not freed)."""
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        """Ids of all registered sequences, in registration order."""
        return list(self._seqs)

    @property
    def num_seqs(self) -> int:
        """Registered sequences."""
        return len(self._seqs)

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table (physical ids in its current pool)."""
        return self._get(seq_id).blocks.copy()

    def block_table_ref(self, seq_id: int) -> list[int]:
        """The internal block-table list, for the hot path. Read only; it changes on
        allocate_slots (copy-on-write replaces its last entry) and on swaps."""
        return self._get(seq_id).blocks

    def num_slots(self, seq_id: int) -> int:
        """Positions of the sequence with a reserved KV slot (``[0, num_slots)``)."""
        return self._get(seq_id).num_slots

    def num_tokens(self, seq_id: int) -> int:
        """Length of the sequence's token list (its known tokens)."""
        return len(self._get(seq_id).token_ids)

    def token_ids(self, seq_id: int) -> list[int]:
        """A copy of the sequence's token ids (read from the caller's list)."""
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
        """Slot of a reserved position, by the slot rule :func:`kvblocks.slot_of`
        (``block_table[position // block_size] * block_size + position % block_size``)."""
        seq = self._get(seq_id)
        if not _is_int(position) or not 0 <= position < seq.num_slots:
            raise ValueError(
                f"sequence {seq_id!r}: position {position!r} has no reserved slot "
                f"(reserved 0..{seq.num_slots - 1}); allocate_slots() first"
            )
        return slot_of(seq.blocks, position, self.block_size)

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Slots of positions ``[start, end)`` (all reserved): the slot mapping of a chunk.

        The slot rule (:func:`kvblocks.slot_of`) gives the first position's slot in each block;
        the following positions of that block have the following slots.
        """
        seq = self._get(seq_id)
        if not (_is_int(start) and _is_int(end) and 0 <= start <= end <= seq.num_slots):
            raise ValueError(
                f"sequence {seq_id!r}: range [{start!r}, {end!r}) is not within the reserved "
                f"slots [0, {seq.num_slots})"
            )
        out: list[int] = []
        bs = self.block_size
        blocks = seq.blocks
        pos = start
        while pos < end:
            stop = min(end, (pos // bs + 1) * bs)  # end of this position's block
            first = slot_of(blocks, pos, bs)
            out.extend(range(first, first + (stop - pos)))
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
        lists: dict[int, int] = {}  # id of a token list -> the sequence that owns it
        for seq in self._seqs.values():
            exp_blocks = (seq.num_slots + self._mask) >> self._shift
            if len(seq.blocks) != exp_blocks:
                problems.append(
                    f"seq {seq.seq_id!r}: {len(seq.blocks)} blocks for {seq.num_slots} slots"
                )
            # without prefix caching, one slot may wait for a token being sampled (pending=1)
            if seq.num_slots > len(seq.token_ids) + (self._cache is None):
                problems.append(f"seq {seq.seq_id!r}: more slots than tokens")
            if id(seq.token_ids) in lists:
                problems.append(
                    f"seq {seq.seq_id!r}: shares its token list with seq {lists[id(seq.token_ids)]!r}"
                )
            lists[id(seq.token_ids)] = seq.seq_id
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
