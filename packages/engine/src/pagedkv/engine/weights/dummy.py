"""Random weights of a real model shape, for benchmarks: no checkpoint needed.

Weights are drawn directly on the target device (on a GPU this takes well under a second even
for 8B parameters). Matrices get a small standard deviation so activations stay finite through
many layers; norm scales are one and biases zero, as in a freshly initialized model.

The draws do not depend on tensor parallelism: a sharded parameter draws its whole tensor (the
single-device model's parameter, from the same generator position) and keeps its rank's slice,
one tensor at a time. So a model split over any number of ranks has exactly the weights of the
single-device model with the same seed, and their outputs can be compared.
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
    modules = dict(model.named_modules())
    generator = torch.Generator(device=params[0][1].device).manual_seed(seed)
    with torch.no_grad():
        for name, param in params:
            module_name, _, leaf = name.rpartition(".")
            if param.ndim == 1 and leaf == "bias":
                param.zero_()
                continue
            if param.ndim == 1:
                param.fill_(1.0)  # norm scales
                continue
            module = modules[module_name]
            full_shape = getattr(module, "full_shape", None)
            shape = tuple(full_shape(leaf)) if full_shape is not None else tuple(param.shape)
            if shape == tuple(param.shape):
                param.normal_(0.0, std, generator=generator)
            else:  # one rank's shard: draw the whole tensor, keep the slice
                full = torch.empty(shape, dtype=param.dtype, device=param.device)
                full.normal_(0.0, std, generator=generator)
                module.load_shard(leaf, full, None, name)
                del full
