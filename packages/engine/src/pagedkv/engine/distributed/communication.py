"""The collectives of tensor-parallel model layers.

Layers call these only when their tensor-parallel size is above one, so a single-device model
runs exactly the operations it ran before tensor parallelism existed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pagedkv.engine.distributed.parallel_state import TPInfo


def all_reduce(x: torch.Tensor, tp: TPInfo | None) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x``."""
    if tp is None or tp.size == 1:
        return x
    dist.all_reduce(x, group=tp.group)
    return x


def gather_last_dim(x: torch.Tensor, tp: TPInfo | None) -> torch.Tensor | None:
    """Rank 0: the ranks' ``x [..., n]`` side by side ``[..., size * n]``; other ranks: None.

    A gather to rank 0 rather than an all-gather: only the driver samples, so only it needs
    the whole vocabulary's logits."""
    if tp is None or tp.size == 1:
        return x
    x = x.contiguous()
    if tp.rank == 0:
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.gather(x, gather_list=parts, dst=0, group=tp.group)
        return torch.cat(parts, dim=-1)
    dist.gather(x, gather_list=None, dst=0, group=tp.group)
    return None
