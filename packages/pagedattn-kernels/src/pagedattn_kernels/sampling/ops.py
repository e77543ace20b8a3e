"""The sampling ops: ``argmax_rows``, the greedy token of each row of logits.

It checks its inputs (``checks``), then runs the implementation that fits the tensors' device
(``pagedattn_kernels.common.resolve_backend``): the Triton kernels (``triton_launch``,
``triton_kernels``) or the torch path (``torch_impl``). ``reference`` holds the exact
definition it is tested against. Public through ``pagedattn_kernels.ops``.
"""

from __future__ import annotations

import torch

from pagedattn_kernels.common import resolve_backend
from pagedattn_kernels.sampling import torch_impl, triton_launch
from pagedattn_kernels.sampling.checks import check_argmax_rows

__all__ = ["argmax_rows"]


def argmax_rows(
    logits: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The index of each row's largest value, int64 ``[rows]`` (written into ``out`` when
    given): exactly ``torch.argmax(logits, dim=-1)``. Ties go to the lowest index; NaN counts
    as the largest value (the first NaN of a row wins, whatever its sign or payload); -0.0
    equals 0.0. ``logits [rows, cols]``: bfloat16, float16 or float32, any row stride (the
    Triton path copies a tensor whose columns are not contiguous first); ``cols`` >= 1.

    Why: a greedy decode step ends with this over a vocabulary of 128,256 tokens (Llama-3),
    and torch's reduction is latency-bound at decode batch sizes: on an H200 about 27 us for
    1-128 rows, 142 us at 1,024, where reading the logits takes 1-55 us. The Triton path
    splits each row over many programs (``triton_launch.pick_chunk``) and merges their
    results in a second small kernel, deterministically (no atomics): on an H200 3.8 / 8.9 /
    15.0 / 53 / 103 us at 16 / 64 / 128 / 512 / 1,024 rows against torch's 26.9 / 27.1 / 27.2 /
    79 / 142 (``scripts/greedy_argmax_bench.py``, 63a4a83)."""
    check_argmax_rows(logits, out)
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if resolve_backend(logits.device, backend) == "torch":
        return torch_impl.argmax_rows(logits, out)
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    return triton_launch.argmax_rows(logits, out)
