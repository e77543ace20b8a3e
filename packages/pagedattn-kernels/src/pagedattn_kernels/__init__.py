"""PagedAttention kernels (Triton on GPU, torch on CPU): cache writes, paged decode and prefill
attention, block copy and swap; and the fused elementwise ops of a decoder layer (RMSNorm with
the residual add, SiLU-and-multiply, rotary embedding).

Tensors only: the caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer,
block tables ``[num_seqs, max_blocks_per_seq]`` int32, slot = block id * block_size + offset.
The backend follows the tensors' device (CUDA -> Triton kernels, CPU -> torch).
``pagedattn_kernels.reference`` holds a float64 reference of each op.
"""

from pagedattn_kernels.__about__ import __version__
from pagedattn_kernels.backend import BACKENDS, resolve_backend
from pagedattn_kernels.fused_ops import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from pagedattn_kernels.ops import (
    copy_blocks,
    paged_attention,
    paged_decode_attention,
    reshape_and_cache,
    swap_blocks,
)
from pagedattn_kernels.swap import swap_stream

__all__ = [
    "BACKENDS",
    "__version__",
    "copy_blocks",
    "fused_add_rms_norm",
    "paged_attention",
    "paged_decode_attention",
    "reshape_and_cache",
    "resolve_backend",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "swap_blocks",
    "swap_stream",
]
