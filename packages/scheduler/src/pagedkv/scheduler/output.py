"""Plain data passed between the scheduler and the model runner, one step at a time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.scheduler.config import PreemptionMode

if TYPE_CHECKING:
    from kvblocks import KVStats
    from pagedkv.scheduler.request import Sequence, SequenceGroup

__all__ = ["ScheduledSequence", "SchedulerOutput", "SchedulerStats", "UpdateResult"]


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of the next forward pass: compute positions [start, start + num_tokens).

    ``block_table`` is the block manager's live list (physical GPU block ids of logical blocks
    0, 1, ...), already grown to cover the new positions: read it, never mutate it, and use it
    before the next :meth:`Scheduler.update` / :meth:`Scheduler.schedule` (they may change it).
    The slot of position p follows kvblocks' slot rule, :func:`kvblocks.slot_of`.
    ``all_token_ids`` is the sequence's live token list; ``token_ids`` slices the positions
    being computed (with an ``AsyncScheduler`` the last one may not be in the list yet: the
    token still being sampled, at position ``len(all_token_ids)``). ``do_sample`` is True when this chunk reaches the end of the known tokens:
    the runner samples the next token from the logits of position ``start + num_tokens - 1``.
    ``is_prefill`` is False exactly for a plain decode (one new token after the prompt).
    """

    seq_id: int
    request_id: str
    start: int
    num_tokens: int
    block_table: list[int]
    all_token_ids: list[int] = field(repr=False)
    is_prefill: bool
    do_sample: bool

    @property
    def token_ids(self) -> list[int]:
        """Token ids of the positions computed in this step (a new list)."""
        return self.all_token_ids[self.start : self.start + self.num_tokens]

    @property
    def context_len(self) -> int:
        """Positions the attention of this step covers (computed before + now)."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One batch. The runner executes, in this order: ``blocks_to_swap_out`` (GPU -> CPU),
    ``blocks_to_swap_in`` (CPU -> GPU), ``blocks_to_copy`` (GPU -> GPU, copy-on-write), then
    the forward pass over ``scheduled``, then samples one token (or several, to fork; or none,
    to drop) for every scheduled sequence with ``do_sample`` and passes them to
    :meth:`Scheduler.update`.

    ``preempted`` lists the requests preempted while building this batch, with the mode used;
    ``finished`` the requests that ended outside ``update`` since the previous output (rejected
    by ``add_request``, aborted, or ended for lack of KV memory).
    """

    scheduled: list[ScheduledSequence]
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]
    num_batched_tokens: int
    preempted: list[tuple[str, PreemptionMode]]
    finished: list[SequenceGroup]
    #: Sequences behind ``scheduled`` (same order), for update().
    seqs: list[Sequence] = field(repr=False)
    #: How many scheduled sequences have do_sample set.
    num_samples: int = 0
    applied: bool = field(default=False, repr=False)

    @property
    def is_empty(self) -> bool:
        """Nothing to run (there may still be finished requests to report)."""
        return not self.scheduled

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)

    @property
    def request_ids(self) -> list[str]:
        """Requests in the batch, each once, in batch order."""
        return list(dict.fromkeys(s.request_id for s in self.scheduled))


@dataclass(slots=True)
class UpdateResult:
    """What :meth:`Scheduler.update` did: forks made, sequences and requests finished."""

    forks: list[tuple[int, int]] = field(default_factory=list)
    finished_seqs: list[Sequence] = field(default_factory=list)
    finished_groups: list[SequenceGroup] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    """Counters for metrics and logs; ``kv`` is the block manager's snapshot."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_running_seqs: int
    num_preemptions: int
    num_recompute_preemptions: int
    num_swap_preemptions: int
    num_rejected: int
    num_aborted: int
    prompt_tokens: int
    generation_tokens: int
    kv: KVStats

    @property
    def gpu_kv_usage(self) -> float:
        return self.kv.gpu_usage

    @property
    def cpu_kv_usage(self) -> float:
        kv = self.kv
        return kv.cpu_used / kv.cpu_total if kv.cpu_total else 0.0
