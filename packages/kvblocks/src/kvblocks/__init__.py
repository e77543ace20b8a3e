"""KV-cache block manager for PagedAttention: block pool, block tables, copy-on-write, swapping, prefix caching. Pure Python, no dependencies."""

from kvblocks.__about__ import __version__

__all__ = ["__version__"]
