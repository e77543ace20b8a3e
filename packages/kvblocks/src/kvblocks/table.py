"""BlockTable: everything the block manager knows about one sequence.

Why a slots dataclass of plain lists: the decode hot path touches one of these per sequence per
step (append a token, reserve a slot), so attribute access must be cheap and the record small.
The manager owns these records; callers see copies (``BlockManager.block_table``) or, on the hot
path, the internal list read-only by convention (``BlockManager.block_table_ref``).

The record keeps, besides the block table proper:

* ``token_ids``: the caller's own live list of the sequence's known tokens (prompt and
  generated), held by reference: the caller appends to it, the manager only reads it (its length
  bounds the slots that may be reserved; a block's tokens are hashed for the prefix cache when
  the block fills). Tokens are stored once, by their owner;
* ``num_slots``: how many positions have a KV slot reserved (``allocate_slots``); always
  ``len(blocks) == ceil(num_slots / block_size)``, so the waste is at most one partly filled
  block;
* ``fast_left``, which lets the decode hot path skip every check but one;
* prefix-cache bookkeeping (only used when prefix caching is on): the content hash of each full
  block computed so far, and for each published block the cache entry that holds its content
  (``None`` when the chain was broken, e.g. by a refused hash collision).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from kvblocks.cache_entry import CacheEntry

__all__ = ["BlockTable"]


@dataclass(slots=True, eq=False)
class BlockTable:
    """Per-sequence block table and token record (internal to :class:`BlockManager`)."""

    seq_id: int
    #: Physical block ids, logical block index -> physical id, in the pool of ``on_gpu``.
    blocks: list[int]
    #: The caller's live list of the sequence's known token ids (a reference, never copied or
    #: changed here).
    token_ids: list[int]
    #: Positions ``[0, num_slots)`` have a reserved KV slot.
    num_slots: int = 0
    #: True while the blocks live in the GPU pool, False after swap out.
    on_gpu: bool = True
    #: Part of the prefix-cache identity (e.g. a LoRA id or multimodal hash); None for none.
    extra_key: Hashable | None = None
    #: Prefix caching: content hash of full block k (hash chain), computed lazily.
    block_hashes: list[Hashable] = field(default_factory=list)
    #: Prefix caching: cache entry holding the content of full block k, for k < len(chain).
    chain: list[CacheEntry | None] = field(default_factory=list)
    #: Hot-path shortcut: slots that ``allocate_slots`` may add without touching any block, as the
    #: partly filled last block belongs to this sequence alone. A conservative cache: 0 is
    #: always safe (the slow path then recomputes it); fork and swap reset it to 0.
    fast_left: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def location(self) -> str:
        return "gpu" if self.on_gpu else "cpu"
