"""Where a notebook runs, and how big its runs are."""

from __future__ import annotations

import os

#: Set to 1 by the test suite: notebooks use fewer tokens and repeats (same code, same checks).
SMALL_ENV = "PAGEDKV_TUTORIAL_SMALL"


def small() -> bool:
    """Whether the test suite asked for the quick run (``PAGEDKV_TUTORIAL_SMALL=1``)."""
    return os.environ.get(SMALL_ENV, "0") == "1"


def describe_device(device) -> str:
    """A line that says where the notebook runs, e.g. ``cuda (NVIDIA H200)`` or ``cpu (2 threads)``."""
    import torch

    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def synchronize(device) -> None:
    """Wait for the GPU's queued work, so that a host clock read afterwards means something."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
