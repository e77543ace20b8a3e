"""The torch path of the prefetch op: nothing to do. A CPU has no L2 to ask, and torch has no
call that asks a GPU's; a hint that is not given changes no value, only time."""

from __future__ import annotations

import torch


def prefetch_l2(tensor: torch.Tensor) -> None:
    del tensor
