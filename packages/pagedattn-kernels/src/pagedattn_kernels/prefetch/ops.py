"""The prefetch op: ``prefetch_l2``, a hint that fetches a tensor into the GPU's L2 cache.

It checks its input (``checks``), then runs the implementation that fits the tensor's device
(``pagedattn_kernels.common.resolve_backend``): the Triton kernel (``triton_launch``,
``triton_kernels``) or the torch path (``torch_impl``, which does nothing). Public through
``pagedattn_kernels.ops``.
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import resolve_backend
from pagedattn_kernels.prefetch import torch_impl, triton_launch
from pagedattn_kernels.prefetch.checks import check_prefetch_l2

__all__ = ["prefetch_l2"]


def prefetch_l2(tensor: torch.Tensor, *, evict_last: bool = True,
                backend: str | None = None) -> None:  # fmt: skip
    """Ask L2 to fetch ``tensor``'s bytes from HBM now, and return at once. No value changes;
    a later kernel that reads ``tensor`` finds its lines in L2 if they are still there.
    ``evict_last``: the lines are marked to be evicted after other lines (L2's ``evict_last``
    priority), so that a stream of other data (the KV cache read by attention) does not push
    them out before they are used.

    Why: in a decode step of a few sequences, attention waits on the latency of its loads and
    leaves the memory bus mostly idle for 10-25 us a layer, then the output projection reads
    its weights (33.5 MB a layer for Llama-3-8B in bf16, less than an H200's 50 MB L2) at
    about 72% of the copy bandwidth. Fetched during attention, those weights come from L2.

    On CUDA (sm_90 and newer) one Triton kernel issues ``cp.async.bulk.prefetch.L2`` over the
    tensor's 16-byte aligned bytes, in chunks of ``triton_launch.CHUNK_BYTES``; it returns as
    soon as the requests are issued, not when the data has arrived. Elsewhere (CPU, older GPUs,
    Triton's interpreter, which has no L2) it does nothing."""
    check_prefetch_l2(tensor)
    if resolve_backend(tensor.device, backend) == "torch":
        torch_impl.prefetch_l2(tensor)
    else:
        triton_launch.prefetch_l2(tensor, evict_last)
