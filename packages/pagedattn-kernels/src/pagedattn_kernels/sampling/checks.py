"""Input checks of the sampling ops, run before anything is written."""

from __future__ import annotations

import torch

from pagedattn_kernels.common import check_float, fail

#: The kernels index a row's columns in int32 (and pack the index into 32 bits).
MAX_COLS = 2**31 - 1


def check_argmax_rows(logits: torch.Tensor, out: torch.Tensor | None) -> None:
    op = "argmax_rows"
    check_float(op, "logits", logits, 2)
    rows, cols = logits.shape
    if cols == 0:
        raise fail(op, f"logits {tuple(logits.shape)} has no columns: a row's argmax needs at "
                       f"least one value")  # fmt: skip
    if cols > MAX_COLS:
        raise fail(op, f"logits rows of {cols} values are too wide (at most {MAX_COLS})")
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (rows,)
        or out.dtype != torch.int64
        or out.device != logits.device
    ):
        got = (f"{out.dtype} of shape {tuple(out.shape)} on {out.device}"
               if isinstance(out, torch.Tensor) else type(out).__name__)  # fmt: skip
        raise fail(op, f"out must be an int64 tensor of shape ({rows},) on {logits.device}, "
                       f"got {got}")  # fmt: skip
