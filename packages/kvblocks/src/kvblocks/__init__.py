"""kvblocks: the KV-cache block manager of PagedAttention, in pure Python (stdlib only).

Why a package of its own: block bookkeeping (pool, free queue, ref counts, block tables,
copy-on-write, swap plans, prefix-cache hashing) is pure integer logic that the scheduler, the
engine and the simulator all need, and it must never pull in torch. It is tested on its own,
exhaustively, and installs with no dependencies.

Quick use::

    from kvblocks import BlockManager

    m = BlockManager(block_size=16, num_gpu_blocks=1024, num_cpu_blocks=256)
    tokens = list(prompt)                          # yours: the manager keeps a reference
    m.allocate(0, tokens)                          # cached tokens (prefix caching) or 0
    m.allocate_slots(0, len(tokens))               # reserve KV slots -> copy-on-write pairs,
                                                   # or None when blocks run out (no change)
    m.slots(0, 0, len(tokens))                     # slot mapping for the forward pass
    tokens.append(next_token)                      # decode: append, then reserve its slot
    m.allocate_slots(0, 1)
"""

from kvblocks.__about__ import __version__
from kvblocks.cache_entry import CacheEntry
from kvblocks.errors import (
    BlockLimitError,
    DoubleFreeError,
    InvalidBlockError,
    KVBlocksError,
    NoFreeBlocksError,
    SequenceExistsError,
    SwapError,
    SwapSpaceError,
    UnknownSequenceError,
)
from kvblocks.layout import check_block_size, slot_of
from kvblocks.manager import BlockManager, InvariantError
from kvblocks.pool import BlockPool
from kvblocks.prefix_cache import HashFn, PrefixCache, default_hash_fn
from kvblocks.stats import KVStats
from kvblocks.table import BlockTable

__all__ = [
    "BlockLimitError",
    "BlockManager",
    "BlockPool",
    "BlockTable",
    "CacheEntry",
    "DoubleFreeError",
    "HashFn",
    "InvalidBlockError",
    "InvariantError",
    "KVBlocksError",
    "KVStats",
    "NoFreeBlocksError",
    "PrefixCache",
    "SequenceExistsError",
    "SwapError",
    "SwapSpaceError",
    "UnknownSequenceError",
    "__version__",
    "check_block_size",
    "default_hash_fn",
    "slot_of",
]
