"""PagedAttention kernels (Triton on GPU, torch on CPU): cache writes, paged decode and prefill attention, block copy and swap."""

from pagedattn_kernels.__about__ import __version__

__all__ = ["__version__"]
