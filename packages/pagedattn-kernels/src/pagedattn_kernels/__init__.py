"""PagedAttention kernels (Triton on GPU, torch on CPU): cache writes, paged decode and prefill
attention, block copy and swap; and the fused elementwise ops of a decoder layer (RMSNorm with
the residual add, SiLU-and-multiply, rotary embedding); fp8 quantization and matmul; the greedy
token of each row of logits.

Tensors only: the caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer,
block tables ``[num_seqs, max_blocks_per_seq]`` int32, slot = block id * block_size + offset.
The backend follows the tensors' device (CUDA -> Triton kernels, CPU -> torch).
Everything public comes from ``pagedattn_kernels.ops`` (re-exported here); each op's code lives
in its folder (``attention/``, ``cache/``, ``fused/``, ``quant/``, ``sampling/``).
``pagedattn_kernels.reference`` holds a float64 reference of each op,
``pagedattn_kernels.testing`` helpers for tests.
"""

from pagedattn_kernels import ops as _ops
from pagedattn_kernels.__about__ import __version__
from pagedattn_kernels.ops import *  # noqa: F403  (the public face is ops.__all__)

__all__ = ["__version__", *_ops.__all__]
