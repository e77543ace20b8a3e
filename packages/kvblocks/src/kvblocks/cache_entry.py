"""CacheEntry: the identity of one full block's content in the prefix cache.

Why a module of its own: both the prefix cache (which creates and looks up entries) and the
block table (which remembers, per full block, the entry holding its content) need this type;
keeping it apart lets each import it directly, with no import cycle between them.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["CacheEntry"]


@dataclass(slots=True, eq=False)
class CacheEntry:
    """One cached full block and the identity of its content (see :mod:`kvblocks.prefix_cache`)."""

    serial: int  # unique for the life of the cache, never reused
    block_hash: Hashable
    parent_hash: Hashable | None
    parent_serial: int  # serial of the parent entry, -1 for a sequence's first block
    token_ids: tuple[int, ...]
    extra_key: Hashable | None
    block_id: int
