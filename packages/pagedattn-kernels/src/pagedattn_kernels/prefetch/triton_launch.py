"""Launcher of the prefetch kernel (``triton_kernels.py``): the aligned range, the chunks and
the grid.

Inputs arrive checked (``ops`` checks them). CUDA tensors get the compiled kernel, CPU tensors
the same kernel in Triton's interpreter (``pagedattn_kernels.common.kernels_for``), which only
records the chunks it would issue (``record=``; the tests read them).
"""

from __future__ import annotations

import functools

import torch

from pagedattn_kernels.common import is_interpreted, kernels_for, use_pdl

KERNELS = "pagedattn_kernels.prefetch.triton_kernels"

#: Bytes per prefetch request. 33.5 MB (a Llama-3-8B output projection in bf16) is 4,096
#: requests, 128 programs of one warp: one per SM of an H200, each issuing 32.
CHUNK_BYTES = 8192
#: Requests per program: one per thread of a single warp.
BLOCK = 32
#: ``cp.async.bulk`` takes 16-byte aligned addresses and sizes.
ALIGN = 16


@functools.lru_cache(maxsize=16)
def _bulk_prefetch(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def aligned_range(address: int, nbytes: int) -> tuple[int, int]:
    """(offset, length): the largest 16-byte aligned range inside ``nbytes`` bytes at
    ``address`` (a hint may skip the few bytes at either end)."""
    head = -address % ALIGN
    return head, max(nbytes - head, 0) // ALIGN * ALIGN


def prefetch_l2(tensor: torch.Tensor, evict_last: bool,
                record: torch.Tensor | None = None) -> None:  # fmt: skip
    """``record`` (int64 ``[chunks, 2]``, for tests): where each chunk's (start, size) in
    bytes from the aligned range's first byte is written. Without it the interpreter (and a
    GPU before sm_90) has nothing to do and nothing is launched."""
    device = tensor.device
    kernel = kernels_for(device, KERNELS).prefetch_l2_kernel
    issue = not is_interpreted(kernel) and device.type == "cuda" and _bulk_prefetch(
        device.index if device.index is not None else torch.cuda.current_device())
    if tensor.numel() == 0 or not (issue or record is not None):
        return
    raw = tensor.reshape(-1).view(torch.uint8)
    head, length = aligned_range(raw.data_ptr(), raw.numel())
    if length == 0:
        return
    chunks = -(-length // CHUNK_BYTES)
    if record is not None and tuple(record.shape) != (chunks, 2):
        raise ValueError(f"record must be [{chunks}, 2] for {length} bytes, got "
                         f"{tuple(record.shape)}")  # fmt: skip
    pdl = issue and use_pdl(device)
    kernel[(-(-chunks // BLOCK),)](
        raw[head:], record if record is not None else raw, length, CHUNK=CHUNK_BYTES, BLOCK=BLOCK,
        ISSUE=issue, EVICT_LAST=evict_last, RECORD=record is not None, PDL=pdl,
        launch_pdl=pdl, num_warps=1,
    )
