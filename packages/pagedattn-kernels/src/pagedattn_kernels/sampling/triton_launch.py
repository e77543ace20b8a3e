"""Launchers of the sampling kernels (``triton_kernels.py``).

Inputs arrive checked (``ops`` checks them). CUDA tensors get the compiled kernels, CPU tensors
the same kernels in Triton's interpreter (``pagedattn_kernels.common.kernels_for``).
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import kernels_for, next_power_of_2, use_pdl

KERNELS = "pagedattn_kernels.sampling.triton_kernels"

#: Columns a program takes (``pick_chunk``): 8,192, a 16-bit row's 16 KB, 16 values a thread
#: of 16 warps, all loaded before any is compared.
CHUNK = 8192
#: The most chunks a row may have: CUDA's limit on the grid's second dimension.
MAX_GRID_Y = 65535

# (integer view, bits of +inf) of each float dtype: the kernels compare the bits.
_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


def pick_chunk(cols: int) -> int:
    """Columns per program: ``CHUNK`` (8,192: 16 programs a row of Llama-3's 128,256), or the
    whole row rounded up to a power of two when shorter. Why: torch's reduction gives a row
    few programs, so at decode batch sizes it waits on memory latency with most of the GPU
    idle (an H200: ~27 us for 1 to 128 rows of 128,256). One width for every row count: the
    kernels' variants then follow the vocabulary alone, so a serving engine compiles them once
    at start-up (``argmax_rows`` of one row) and never while it serves; a width per row count
    (1,024 columns for one row, up to 16,384 from 64) compiled three more variants of each
    kernel inside each timed H200 run (01d9676), for a few microseconds at most."""
    return min(CHUNK, next_power_of_2(cols))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``out[r]`` = the first column of row r's largest value (torch's order, NaN largest).
    ``logits [rows, cols]`` with unit column stride. ``chunk`` (a power of two from 16)
    forces the columns per program, for tests and experiments; default ``pick_chunk``."""
    rows, cols = logits.shape
    if rows == 0:
        return out
    kernels = kernels_for(logits.device, KERNELS)
    if chunk is None:
        chunk = pick_chunk(cols)
    elif chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two from 16, got {chunk}")
    if -(-cols // chunk) > MAX_GRID_Y:  # rows of over a billion values: wider chunks
        chunk = next_power_of_2(-(-cols // MAX_GRID_Y))
    chunks = -(-cols // chunk)
    view, inf_bits = _BITS[logits.dtype]
    sign = -(1 << (torch.iinfo(view).bits - 1))
    direct = chunks == 1
    part = out if direct else torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    pdl = use_pdl(logits.device)
    kernels.argmax_chunks_kernel[(rows, chunks)](
        logits.view(view), part, out, cols, logits.stride(0), out.stride(0), chunks,
        CHUNK=chunk, SIGN=sign, INF_BITS=inf_bits, DIRECT=direct, PDL=pdl, launch_pdl=pdl,
        num_warps=min(16, max(4, chunk // 512)),
    )  # fmt: skip
    if not direct:
        kernels.argmax_merge_kernel[(rows,)](
            part, out, chunks, out.stride(0), CHUNKS_P2=next_power_of_2(chunks), PDL=pdl,
            launch_pdl=pdl, num_warps=4 if chunks > 128 else 1,
        )  # fmt: skip
    return out
