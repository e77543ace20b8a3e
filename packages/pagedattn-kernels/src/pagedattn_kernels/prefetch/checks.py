"""Input checks of the prefetch op, run before anything is launched."""

from __future__ import annotations

import torch

from pagedattn_kernels.common import fail


def check_prefetch_l2(tensor: torch.Tensor) -> None:
    op = "prefetch_l2"
    if not isinstance(tensor, torch.Tensor):
        raise fail(op, f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise fail(op, f"tensor {tuple(tensor.shape)} with strides {tensor.stride()} is not "
                       f"contiguous: its bytes are not one range to fetch")  # fmt: skip
