"""Random weights of a real model shape, for benchmarks: no checkpoint needed.

Weights are drawn directly on the target device (on a GPU this takes well under a second even
for 8B parameters). Matrices get a small standard deviation so activations stay finite through
many layers; norm scales are one and biases zero, as in a freshly initialized model.
"""

from __future__ import annotations

import torch
from torch import nn

DEFAULT_STD = 0.02


def init_dummy_weights(model: nn.Module, *, std: float = DEFAULT_STD, seed: int = 0) -> None:
    """Fill every parameter of a materialized model in place (seeded, reproducible)."""
    params = list(model.named_parameters())
    if not params or params[0][1].device.type == "meta":
        return
    generator = torch.Generator(device=params[0][1].device).manual_seed(seed)
    with torch.no_grad():
        for name, param in params:
            leaf = name.rsplit(".", 1)[-1]
            if param.ndim == 1 and leaf == "bias":
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)  # norm scales
            else:
                param.normal_(0.0, std, generator=generator)
