"""What a tensor-parallel model layer needs: its place in the group (:class:`TPInfo`) and the
collectives it calls.

Layers call the collectives only when their tensor-parallel size is above one, so a
single-device model runs exactly the operations it ran before tensor parallelism existed.

The model code imports this module and nothing else of ``distributed``: process groups and the
start-time checks (:mod:`~pagedkv.engine.distributed.parallel_state`) sit above the model
registry, which names the model modules, so the model modules must not reach them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPInfo:
    """What a model layer needs to know: its rank, the number of ranks, and the group of its
    collectives (``None``: the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None


def tp_rank_size(tp: TPInfo | None) -> tuple[int, int]:
    """(rank, size) of ``tp``; (0, 1) without tensor parallelism."""
    return (0, 1) if tp is None else (tp.rank, tp.size)


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


def argmax_over_ranks(local_logits: torch.Tensor, vocab_start: int, tp: TPInfo | None) -> torch.Tensor:
    """The argmax over the whole vocabulary of logits split by vocabulary slices (this rank's
    ``local_logits [N, slice]`` start at token id ``vocab_start``), on every rank alike.

    Each rank reduces its slice to (largest logit, its token id) per row and an all-gather
    exchanges those two numbers: ``2 * N`` values per rank instead of the whole vocabulary's
    logits. Ties go to the lowest token id, as ``torch.argmax`` of the gathered logits does, so
    the result is that argmax exactly. Entries past the vocabulary (padding) must be ``-inf``."""
    mine = slice_best(local_logits, vocab_start)
    if tp is None or tp.size == 1:
        return mine[1].long()
    both = mine.new_empty((tp.size * 2, mine.shape[1]))  # the ranks' pairs, one after another
    _all_gather_single(both, mine, tp.group)
    return pick_best(both.view(tp.size, 2, -1))


def slice_best(local_logits: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """``[2, N]`` float64: per row the largest logit of the slice and its token id (the first
    one where several are equal); both exact in float64."""
    values, index = local_logits.max(dim=-1)
    return torch.stack((values.double(), (index + vocab_start).double()))


def pick_best(pairs: torch.Tensor) -> torch.Tensor:
    """Token ids (int64) from the ranks' ``slice_best`` pairs ``[ranks, 2, N]``, ranks in
    vocabulary order: the largest logit, the lowest rank (so the lowest id) among equals."""
    best = pairs[:, 0].argmax(dim=0)  # the first largest
    return pairs[:, 1].gather(0, best.unsqueeze(0)).squeeze(0).long()


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    """``out[r] = x`` of rank r (``all_gather_single`` since torch 2.13, before it
    ``all_gather_into_tensor``)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)
