"""Compiling the decode kernels' variants ahead of time (host code, not an op: it computes
nothing; ``pagedattn_kernels.ops`` re-exports it).

Triton compiles a kernel the first time it meets a new combination of its compile-time
arguments, about a second each on an H200 host. A server that compiled in the middle of a
request would stall every stream for that second, so it compiles them all at start-up.
"""

from __future__ import annotations

import torch

from pagedattn_kernels.attention import triton_launch
from pagedattn_kernels.common import check_caches, check_kv_scales, fail, resolve_backend

__all__ = ["warm_up_decode_attention"]


def warm_up_decode_attention(
    num_heads: int,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_seq_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str | None = None,
) -> int:
    """Compile now every kernel variant :func:`paged_decode_attention` can pick for queries of
    ``num_heads`` heads in ``dtype`` on these caches, with at most ``max_num_seqs`` rows of
    contexts of at most ``max_seq_len`` tokens: its tile configurations, every split count,
    by a plan or not. Returns the number of calls it made (0 on the torch path, which
    compiles nothing). A server calls it at start-up, so that no request meets a compile
    (about a second a variant on an H200); nothing in the caches changes."""
    op = "warm_up_decode_attention"
    for name, value in (("num_heads", num_heads), ("max_num_seqs", max_num_seqs),
                        ("max_seq_len", max_seq_len)):  # fmt: skip
        if type(value) is not int or value < 1:
            raise fail(op, f"{name} must be a positive int, got {value!r}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise fail(op, f"dtype must be float16, bfloat16 or float32, got {dtype}")
    num_kv_heads = check_caches(op, key_cache, value_cache)[2]
    if num_heads % num_kv_heads:
        raise fail(op, f"num_heads ({num_heads}) must be a multiple of the caches' KV heads "
                       f"({num_kv_heads})")  # fmt: skip
    check_kv_scales(op, key_cache, k_scale, v_scale)
    if resolve_backend(key_cache.device, backend) == "torch":
        return 0
    return triton_launch.warm_up_decode(num_heads, key_cache, value_cache, dtype, max_num_seqs,
                                        max_seq_len, k_scale, v_scale)  # fmt: skip
