"""Launchers of the sampling kernels (``triton_kernels.py``).

Inputs arrive checked (``ops`` checks them). CUDA tensors get the compiled kernels, CPU tensors
the same kernels in Triton's interpreter (``pagedattn_kernels.common.kernels_for``).
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import kernels_for, next_power_of_2, sm_count, use_pdl

KERNELS = "pagedattn_kernels.sampling.triton_kernels"

#: Chunk widths (columns a program takes): from 1,024 (a 16-bit row's 2 KB, one 16-byte
#: load per thread of 4 warps) to 16,384 (32 KB: 32 values a thread of 16 warps, all loaded
#: before any is compared).
MIN_CHUNK = 1024
MAX_CHUNK = 16384
#: Programs aimed at per SM: several of them resident on each, their loads all in flight.
PROGRAMS_PER_SM = 4
#: The most chunks a row may have: CUDA's limit on the grid's second dimension.
MAX_GRID_Y = 65535

# (integer view, bits of +inf) of each float dtype: the kernels compare the bits.
_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


def pick_chunk(rows: int, cols: int, sms: int) -> int:
    """Columns per program: the power of two that makes about ``PROGRAMS_PER_SM * sms``
    programs of ``rows * cols`` values, within ``MIN_CHUNK .. MAX_CHUNK`` and at most the row
    (rounded up to a power of two). Why: torch's reduction gives a row few programs, so at
    decode batch sizes it waits on memory latency with most of the GPU idle (an H200: ~27 us
    for 1 to 128 rows of 128,256). On 132 SMs and 128,256 columns: 1,024 columns (126 chunks
    a row) for one row, 4,096 for 16 rows, 16,384 (8 chunks) from 64 rows on, where there are
    enough rows to fill the SMs. A narrower vocabulary may fit one chunk: then one kernel."""
    want = next_power_of_2(-(-rows * cols // (PROGRAMS_PER_SM * sms)))
    return min(max(want, MIN_CHUNK), MAX_CHUNK, next_power_of_2(cols))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``out[r]`` = the first column of row r's largest value (torch's order, NaN largest).
    ``logits [rows, cols]`` with unit column stride. ``chunk`` (a power of two from 16)
    forces the columns per program, for tests and experiments; default ``pick_chunk``."""
    rows, cols = logits.shape
    if rows == 0:
        return out
    kernels = kernels_for(logits.device, KERNELS)
    if chunk is None:
        chunk = pick_chunk(rows, cols, sm_count(logits.device))
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
