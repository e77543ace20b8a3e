"""AsyncScheduler: schedule step N+1 while step N still runs (asynchronous scheduling).

Why a subclass: the plain scheduler is the whole algorithm; scheduling ahead adds one idea and
a few rules on top, and keeping them here leaves ``Scheduler._schedule`` free of them (as vLLM V1
keeps its ``AsyncScheduler`` apart).

The idea: the tokens sampled in step N are not known on the host when step N+1 is built, so each
sequence that samples in N gets a *placeholder*: ``Sequence.num_pending_tokens = 1``. The plain
scheduling rule then counts ``len(token_ids) + num_pending_tokens`` known tokens, schedules the
coming token's position (``start == len(all_token_ids)``) and reserves its KV slot through the
block manager's ``allocate_slots(seq, n, pending=1)``; the runner reads the token where the
sampler leaves it, on the device. ``update(N)`` appends the real tokens and clears the
placeholders.

The rules (checked by :meth:`AsyncScheduler.can_schedule_ahead`): no prefix caching (it hashes
a block's tokens when the block fills, and the coming token is not known), nothing swapped out,
every running request has one sequence (a fork at the first token would copy a slot computed for
the parent), and enough free blocks above the watermark for every running sequence's next chunk,
so that nothing has to be preempted while a step is in flight. Outputs are applied in the order they were scheduled.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC

from pagedkv.scheduler.config import PreemptionMode, SchedulerConfig
from pagedkv.scheduler.output import SchedulerOutput, UpdateResult
from pagedkv.scheduler.request import Sequence, SequenceGroup, SequenceStatus
from pagedkv.scheduler.scheduler import Scheduler

__all__ = ["AsyncScheduler"]

_RUNNING = SequenceStatus.RUNNING


class AsyncScheduler(Scheduler):
    """A :class:`Scheduler` that can also build the next batch before the latest one is applied.

    Use it like the plain scheduler; when :meth:`can_schedule_ahead` holds, the engine may call
    :meth:`schedule_ahead` instead of applying the latest output first, then ``update`` the two
    outputs in the order they were scheduled.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        """Same arguments as :class:`Scheduler`."""
        super().__init__(config)
        # The output before the latest one (scheduled ahead of it), until it is applied.
        self._prev_output: SchedulerOutput | None = None
        # The output whose samples the placeholders stand for, and the sequences that got one.
        self._placeholders_for: SchedulerOutput | None = None
        self._placeholders: list[Sequence] = []
        self._scheduling_ahead = False
        #: Batches built by :meth:`schedule_ahead` so far (the rest went through ``schedule``).
        self.num_scheduled_ahead = 0

    def can_schedule_ahead(self) -> bool:
        """Whether :meth:`schedule_ahead` may build the next batch now: prefix caching is
        off (it hashes a block's tokens when the block fills, and the coming tokens are not
        known), the latest output is not applied yet (and the one before it is), no request
        is swapped out, every running request has one sequence (n = 1), and every running
        sequence can take its next chunk without a preemption, above the watermark: a free
        block for each decode, and what the block manager says a sequence still in its prefill
        needs for its next chunk (at most the token budget)."""
        last = self._last_output
        if last is None or last.applied or self.config.enable_prefix_caching:
            return False
        prev = self._prev_output
        if (prev is not None and not prev.applied) or self._swapped:
            return False
        bm = self.block_manager
        budget = self._budget
        need = 0
        for g in self._running:
            if g.params.n != 1 or len(g.seqs) != 1:  # n > 1 forks at its first token
                return False
            s = g.seqs[0]
            left = len(s.token_ids) - s.num_computed_tokens  # 0: its token is being sampled
            if left <= 1:
                need += 1  # one decode: at most one new block (nothing is shared with n = 1)
            else:
                need += bm.blocks_needed(s.seq_id, min(left, budget))
        return bm.num_free_blocks >= need + self._wm

    def schedule_ahead(self) -> SchedulerOutput:
        """The next batch, built while the latest one still runs (asynchronous scheduling).

        Each sequence that samples in the latest output counts its token to come as known (a
        placeholder): it is scheduled at that token's position, which ``all_token_ids`` does not
        hold yet (``start == len(all_token_ids)``), and the runner reads the token where the
        sampler leaves it, on the device. A sequence whose coming token ends it by length is left
        out. Waiting requests are admitted as usual; nothing is preempted or swapped (see
        :meth:`can_schedule_ahead`, which must hold). Pass the latest output to :meth:`update`
        first, then this one. A sequence that its coming token stops (EOS, stop token) finishes
        in that update; its row of this batch is computed and then ignored, and its blocks go
        back to the pool, to be written again only by later passes.
        """
        if not self.can_schedule_ahead():
            raise RuntimeError(
                "schedule_ahead() needs an unapplied latest output, nothing swapped, single-"
                "sequence requests and a free block per running sequence; use schedule()"
            )
        last = self._last_output
        marked = []
        for ss, s in zip(last.scheduled, last.seqs):
            if ss.do_sample and s.status is _RUNNING:
                s.num_pending_tokens = 1
                marked.append(s)
        self._prev_output = last
        self._placeholders_for = last
        self._placeholders = marked
        self._scheduling_ahead = True
        self.num_scheduled_ahead += 1
        try:
            return self._schedule()
        finally:
            self._scheduling_ahead = False

    def update(
        self, output: SchedulerOutput, samples: Mapping[int, SequenceABC[int]]
    ) -> UpdateResult:
        """Apply the sampled tokens of ``output`` (see :meth:`Scheduler.update`).

        With a batch scheduled ahead, two outputs are unapplied: the one before the latest must
        be applied first. Applying it replaces its sequences' placeholders by their tokens.
        """
        prev = self._prev_output
        if output is not self._last_output and (output is not prev or prev.applied):
            raise ValueError(
                "update() needs the SchedulerOutput returned by the latest schedule() call"
            )
        if output.applied:
            raise ValueError("this SchedulerOutput was already passed to update()")
        if output is not prev and prev is not None and not prev.applied:
            raise ValueError(
                "update() the output before the latest (schedule_ahead) first: outputs are "
                "applied in the order they were scheduled"
            )
        result = self._apply(output, samples)
        if output is self._placeholders_for:
            for s in self._placeholders:
                s.num_pending_tokens = 0  # its token is in token_ids now (or it finished)
            self._placeholders_for = None
            self._placeholders = []
        return result

    def _preempt_latest(
        self,
        g: SequenceGroup,
        swap_out: list[tuple[int, int]],
        preempted: list[tuple[str, PreemptionMode]],
    ) -> bool:
        if self._scheduling_ahead:  # can_schedule_ahead() rules this out
            raise RuntimeError("schedule_ahead() ran out of blocks")
        return super()._preempt_latest(g, swap_out, preempted)
