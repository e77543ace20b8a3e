"""KVStats: one snapshot of the KV cache's accounting.

Why a separate frozen record: the engine logs it and the server exports it as Prometheus
gauges; a plain dataclass of numbers is cheap to build (``BlockManager.stats()`` is O(blocks in
use), call it once per step or less) and safe to hand around.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["KVStats"]


@dataclass(frozen=True, slots=True)
class KVStats:
    """Accounting of both pools and the prefix cache.

    - ``kv_utilization``: token slots holding data / slots in used GPU blocks (a block shared by
      several sequences counts once); 1.0 when no GPU block is in use (no slot is wasted).
    - ``fragmentation``: ``1 - kv_utilization``, the internal waste of partly filled blocks.
    - ``prefix_cache_queries`` / ``prefix_cache_hits``: counted in blocks, over ``allocate``
      calls (a query is each full block a prompt could take from the cache).
    - ``blocks_saved_by_sharing``: sum over used GPU blocks of ``ref_count - 1``.
    - ``gpu_usage``: ``gpu_used / gpu_total`` (0.0 for an empty pool).
    """

    gpu_total: int
    gpu_free: int
    gpu_used: int
    cpu_total: int
    cpu_free: int
    cpu_used: int
    kv_utilization: float
    fragmentation: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    blocks_saved_by_sharing: int
    gpu_usage: float
    # Additions beyond the contract.
    num_sequences: int = 0
    prefix_cached_blocks: int = 0
    prefix_cache_evictions: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries (0.0 before the first query)."""
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (for logging and JSON)."""
        d = asdict(self)
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d
