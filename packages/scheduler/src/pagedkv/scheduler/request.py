"""Requests as the scheduler sees them: sequence groups of sequences of token ids.

A request (one prompt) is a :class:`SequenceGroup`. It starts with one :class:`Sequence`; parallel
samples (``n > 1``) and beams are forked from it once the prompt is computed, and share its KV
blocks. The group is the unit of scheduling and preemption: its sequences are always all in the
same state (waiting, running or swapped) and step in lockstep (they all sample in the same step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["FinishReason", "RequestParams", "Sequence", "SequenceGroup", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    """Where a sequence (or a whole group) is in its life."""

    WAITING = "waiting"  # queued, holds no GPU blocks (new, or preempted by recompute)
    RUNNING = "running"  # holds GPU blocks, scheduled every step while the budget allows
    SWAPPED = "swapped"  # preempted by swap: its blocks are in the CPU pool
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


class FinishReason(enum.StrEnum):
    """Why a sequence or a request ended."""

    STOP = "stop"  # EOS or a stop token (or a stop string, reported by the engine)
    LENGTH = "length"  # max_tokens, or the maximum model length / KV cache capacity
    ABORTED = "aborted"  # abort(), or a sequence dropped by the sampler (pruned beam)
    REJECTED = "rejected"  # can never fit (too long for the model or the KV cache)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(slots=True)
class RequestParams:
    """The parts of the sampling parameters the scheduler acts on.

    ``n``: the most sequences the request may have at once (parallel samples or the beam width);
    sequences beyond the first are forked by :meth:`Scheduler.update` when it receives several
    sampled tokens for one sequence. ``max_tokens`` None means "until the maximum model length".
    ``min_tokens`` suppresses both EOS and ``stop_token_ids`` until that many tokens were
    generated (as vLLM does).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] | tuple[int, ...] = ()
    eos_token_id: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if isinstance(self.stop_token_ids, str | bytes) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}"
            )
        if self.eos_token_id is not None:
            _check_int("eos_token_id", self.eos_token_id, 0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens: the prompt followed by the tokens generated so far.

    ``token_ids`` is the live list (prompt + output) and the only copy of the sequence's tokens:
    the block manager holds a reference to this very list (``BlockManager.allocate``) and reads
    it, the scheduler appends each sampled token to it. Treat it as read-only outside the
    scheduler. ``num_computed_tokens`` counts the positions whose KV is computed or being
    computed in the current step (the scheduler advances it when it schedules a chunk).
    ``num_pending_tokens`` counts tokens being sampled but not yet appended (0, or 1 while an
    :class:`~pagedkv.scheduler.AsyncScheduler` has scheduled the step after the one in flight):
    the scheduler treats ``len(token_ids) + num_pending_tokens`` tokens as known.
    ``index`` orders the sequences of a group by creation (0 is the first); forks get the next
    free index.
    """

    seq_id: int
    group: SequenceGroup = field(repr=False)
    token_ids: list[int] = field(repr=False)
    prompt_len: int
    index: int = 0
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    #: The stop token that ended the sequence (or a stop string, set by the engine).
    stop_reason: int | str | None = None

    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens."""
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request: its sequences, parameters and state.

    ``seqs`` holds the unfinished sequences in creation order, ``finished_seqs`` the others (in
    the order they finished). ``finish_reason`` is set when the request ended as a whole
    (``REJECTED`` with ``reason_text``, or ``ABORTED``); a request that ended because each of its
    sequences did leaves it None (see each sequence's ``finish_reason``).
    """

    request_id: str
    prompt_token_ids: list[int] = field(repr=False)
    params: RequestParams
    arrival_time: float
    #: Position in arrival (add_request) order; FCFS and the preemption victim follow it.
    arrival_index: int = 0
    extra_key: object = None
    state: SequenceStatus = SequenceStatus.WAITING
    seqs: list[Sequence] = field(default_factory=list, repr=False)
    finished_seqs: list[Sequence] = field(default_factory=list, repr=False)
    finish_reason: FinishReason | None = None
    reason_text: str | None = None
    num_preemptions: int = 0
    #: Next index to give a forked sequence.
    next_index: int = 1
    #: Time the request finished (set by the simulator / engine; the scheduler leaves it).
    finished_time: float | None = None
    #: How the request's tokens are sampled: set by the engine, read by its model runner,
    #: opaque to the scheduler (which never samples).
    sampling: object = field(default=None, repr=False)
    _stop_ids: frozenset[int] = field(default=frozenset(), repr=False)
    _max_tokens: int = field(default=0, repr=False)

    @property
    def is_finished(self) -> bool:
        return self.state is SequenceStatus.FINISHED

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def all_seqs(self) -> list[Sequence]:
        """Every sequence of the request, finished or not, in creation (index) order."""
        return sorted(self.seqs + self.finished_seqs, key=lambda s: s.index)
