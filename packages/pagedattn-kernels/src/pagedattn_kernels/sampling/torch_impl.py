"""The torch path of the sampling ops (the CPU path, and a fallback anywhere).

Inputs arrive checked (``ops`` checks them).
"""

from __future__ import annotations

import torch


def argmax_rows(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` into ``out``."""
    return torch.argmax(logits, dim=-1, out=out)
