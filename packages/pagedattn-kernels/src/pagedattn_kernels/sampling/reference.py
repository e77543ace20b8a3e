"""The reference of the sampling ops, written for obviousness: each row's values as Python
floats (float64, exact for every float dtype), searched in order."""

from __future__ import annotations

import math

import torch

__all__ = ["argmax_rows"]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows]`` on ``logits``' device: in each row, the index of the first NaN if
    there is one, else of the first value equal to the row's largest (-0.0 equals 0.0)."""
    found = []
    for row in logits.detach().to(device="cpu", dtype=torch.float64).tolist():
        nans = [i for i, v in enumerate(row) if math.isnan(v)]
        found.append(nans[0] if nans else row.index(max(row)))
    return torch.tensor(found, dtype=torch.int64, device=logits.device)
