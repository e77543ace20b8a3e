"""The reference of the prefetch op: it changes no value anywhere (a hint to the cache, not a
computation). Tests check that the Triton path leaves every tensor as it was."""

from __future__ import annotations

import torch

__all__ = ["prefetch_l2"]


def prefetch_l2(tensor: torch.Tensor) -> None:
    """Nothing: ``tensor`` and every other value stay as they are."""
    del tensor
