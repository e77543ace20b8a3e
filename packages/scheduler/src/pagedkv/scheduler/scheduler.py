"""The FCFS iteration-level scheduler: which sequences run in the next forward pass.

One rule covers prefill, decode and chunked prefill (as in vLLM V1): every sequence has known
tokens (prompt + generated) and computed tokens (KV in the cache); each step, the computed tokens
of as many sequences as fit catch up with their known tokens, under a token budget
(``max_num_batched_tokens``) and a sequence limit (``max_num_seqs``). A new prompt is a sequence
with many known and no computed tokens; a decode is one known token not yet computed.

Order inside a step: running groups first (FCFS, so decodes are never starved by new prompts),
then swapped groups coming back, then waiting requests in arrival order. FCFS is strict: a
waiting request that does not fit stops admission, later ones are not tried.

When a running group needs a block and none is free (the block manager's
``allocate_slots`` answers None, or its ``group_blocks_needed`` exceeds ``num_free_blocks``),
the most recently arrived running group is preempted, all of its sequences at once, and the
allocation is tried again (as in vLLM V1): recompute (free its blocks; it goes back to the head of
the waiting queue and is prefilled again, generated tokens included) or swap (its blocks move to
the CPU pool; swapped groups resume before any new request). All block arithmetic is the block
manager's: the scheduler asks it, and never counts blocks or reads its pools.

The sequences of a group step in lockstep: a group is scheduled only as a whole, and when its
pending tokens do not all fit in the budget, each sequence holds back its last token, so all of
them reach their end (and sample) in the same step. That is what parallel sampling and beam
search need.

A sequence's known tokens are ``len(token_ids) + num_pending_tokens``: the placeholder count is 0
here and 1 while :class:`~pagedkv.scheduler.AsyncScheduler` schedules the step after the one in
flight, whose tokens are not sampled yet (see ``async_scheduler.py``).
"""

from __future__ import annotations

import logging
import time
from bisect import insort
from collections import deque
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceABC
from operator import attrgetter

from kvblocks import BlockManager
from pagedkv.scheduler.config import PreemptionMode, SchedulerConfig
from pagedkv.scheduler.output import (
    ScheduledSequence,
    SchedulerOutput,
    SchedulerStats,
    UpdateResult,
)
from pagedkv.scheduler.request import (
    FinishReason,
    RequestParams,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING
_WAITING = SequenceStatus.WAITING
_SWAPPED = SequenceStatus.SWAPPED
_FINISHED = SequenceStatus.FINISHED
_RECOMPUTE = PreemptionMode.RECOMPUTE
_SWAP = PreemptionMode.SWAP
_STOP = FinishReason.STOP
_LENGTH = FinishReason.LENGTH
_ABORTED = FinishReason.ABORTED
_REJECTED = FinishReason.REJECTED
_by_arrival = attrgetter("arrival_index")


def _insert_by_arrival(queue: deque[SequenceGroup], g: SequenceGroup) -> None:
    """Insert into a queue kept in arrival order; a preempted group usually goes to the front."""
    key = g.arrival_index
    for i, other in enumerate(queue):
        if other.arrival_index > key:
            queue.insert(i, g)
            return
    queue.append(g)


class Scheduler:
    """FCFS iteration-level scheduler over a :class:`kvblocks.BlockManager`.

    Use: ``add_request`` any time; then every step ``out = schedule()``, run the model on
    ``out``, ``update(out, samples)``. ``abort`` works in any state. The scheduler is not
    thread-safe: call it from one thread (the engine loop).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        """A scheduler with an empty :class:`kvblocks.BlockManager` sized by ``config``."""
        if not isinstance(config, SchedulerConfig):
            raise ValueError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        #: The block manager: the runner may read it (slots, tables); only the scheduler changes it.
        self.block_manager = BlockManager(
            block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks,
            num_cpu_blocks=config.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self._budget = config.max_num_batched_tokens
        self._max_seqs = config.max_num_seqs
        self._chunked = config.enable_chunked_prefill
        self._mode: PreemptionMode | None = config.preemption_mode  # type: ignore[assignment]
        self._wm = config.watermark_blocks
        # A sequence stops at max_model_len or when it would not fit in the whole KV cache.
        self._max_len = min(config.max_model_len, config.num_gpu_slots)

        self._waiting: deque[SequenceGroup] = deque()
        self._running: list[SequenceGroup] = []  # in arrival order: the last one is the victim
        self._swapped: deque[SequenceGroup] = deque()
        self._groups: dict[str, SequenceGroup] = {}  # unfinished requests
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences
        self._finished_pending: list[SequenceGroup] = []  # reported by the next schedule()
        self._running_reserve = 0  # sum of params.n over running groups (sequence slots)
        self._next_seq_id = 0
        self._next_arrival = 0
        self._last_output: SchedulerOutput | None = None

        self._num_preemptions = 0
        self._num_recompute = 0
        self._num_swap = 0
        self._num_rejected = 0
        self._num_aborted = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0

    # ================================================================ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        params: RequestParams | None = None,
        arrival_time: float | None = None,
        extra_key: object = None,
    ) -> SequenceGroup:
        """Queue a request (FCFS: arrival order is the order of these calls).

        A request that can never run (prompt + 1 token longer than ``max_model_len`` or than the
        whole KV cache, more sequences than ``max_num_seqs``...) is finished at once as
        ``REJECTED`` with ``reason_text`` and reported in the next output's ``finished``.
        Raises ValueError (and changes nothing) for a bad argument or a request id in use.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._groups or any(
            g.request_id == request_id for g in self._finished_pending
        ):
            raise ValueError(
                f"request id {request_id!r} is already in use; wait until it finished or "
                "choose another id"
            )
        if params is None:
            params = RequestParams()
        elif not isinstance(params, RequestParams):
            raise ValueError(f"params must be a RequestParams, got {type(params).__name__}")
        if isinstance(prompt_token_ids, str | bytes):
            raise ValueError("prompt_token_ids must be token ids (ints), not text; tokenize first")
        try:
            tokens = list(prompt_token_ids)
        except TypeError:
            raise ValueError(
                f"prompt_token_ids must be an iterable of ints, got {type(prompt_token_ids).__name__}"
            ) from None
        if not tokens:
            raise ValueError(
                f"request {request_id!r}: the prompt is empty; give at least one token"
            )
        # Plain ints >= 0 are checked at C speed (a long prompt is 100k tokens); anything
        # else goes through the loop that names the first bad one.
        if not (set(map(type, tokens)) == {int} and min(tokens) >= 0):
            for t in tokens:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(
                        f"request {request_id!r}: prompt token ids must be ints >= 0, found {t!r}"
                    )
        if arrival_time is None:
            arrival_time = time.monotonic()
        elif isinstance(arrival_time, bool) or not isinstance(arrival_time, int | float):
            raise ValueError(f"arrival_time must be a number (seconds), got {arrival_time!r}")
        try:
            hash(extra_key)
        except TypeError:
            raise ValueError(f"extra_key must be hashable, got {extra_key!r}") from None

        g = SequenceGroup(
            request_id=request_id,
            prompt_token_ids=tokens,
            params=params,
            arrival_time=float(arrival_time),
            arrival_index=self._next_arrival,
            extra_key=extra_key,
        )
        g._stop_ids = frozenset(params.stop_token_ids)
        g._max_tokens = params.max_tokens if params.max_tokens is not None else self._max_len
        self._next_arrival += 1
        seq = Sequence(self._new_seq_id(), g, tokens.copy(), len(tokens))
        g.seqs.append(seq)

        reason = self._why_never_fits(len(tokens), params)
        if reason is not None:
            seq.status = _FINISHED
            seq.finish_reason = _REJECTED
            g.seqs.clear()
            g.finished_seqs.append(seq)
            g.state = _FINISHED
            g.finish_reason = _REJECTED
            g.reason_text = f"request {request_id!r} rejected: {reason}"
            self._finished_pending.append(g)
            self._num_rejected += 1
            logger.info("%s", g.reason_text)
            return g

        self._groups[request_id] = g
        self._seqs[seq.seq_id] = seq
        self._waiting.append(g)
        self._prompt_tokens += len(tokens)
        return g

    def _why_never_fits(self, prompt_len: int, params: RequestParams) -> str | None:
        cfg = self.config
        if prompt_len + 1 > cfg.max_model_len:
            return (
                f"the prompt has {prompt_len} tokens; with one generated token that exceeds "
                f"max_model_len={cfg.max_model_len}; shorten the prompt"
            )
        if prompt_len + 1 > cfg.num_gpu_slots:
            return (
                f"the prompt has {prompt_len} tokens; with one generated token that exceeds the "
                f"whole KV cache ({cfg.num_gpu_blocks} blocks x {cfg.block_size} = "
                f"{cfg.num_gpu_slots} token slots); shorten the prompt or give the cache more memory"
            )
        if params.n > cfg.max_num_seqs:
            return f"n={params.n} sequences exceed max_num_seqs={cfg.max_num_seqs}; lower n"
        if params.n > cfg.max_num_batched_tokens:
            return (
                f"n={params.n} sequences cannot decode in one batch of "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens}; lower n"
            )
        return None

    def _new_seq_id(self) -> int:
        i = self._next_seq_id
        self._next_seq_id = i + 1
        return i

    # ================================================================ schedule
    def schedule(self) -> SchedulerOutput:
        """Build the next batch (see the module docstring for the rules).

        Every output with sequences to sample must be passed to :meth:`update` before the next
        call (RuntimeError otherwise).
        """
        last = self._last_output
        if last is not None and not last.applied and last.num_samples:
            raise RuntimeError(
                "the previous SchedulerOutput has sequences to sample and was not passed to "
                "update(); call update(output, samples) before schedule()"
            )
        return self._schedule()

    def _schedule(self) -> SchedulerOutput:
        """Build the next batch from the current state (each sequence's known tokens count its
        placeholders, ``num_pending_tokens``)."""
        bm = self.block_manager
        allocate_slots = bm.allocate_slots
        table_ref = bm.block_table_ref
        chunked = self._chunked
        running = self._running

        scheduled: list[ScheduledSequence] = []
        seq_objs: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted: list[tuple[str, PreemptionMode]] = []
        budget = self._budget
        num_samples = 0
        blocked = False  # a group could not be scheduled: FCFS, nothing after it may go

        # ---- 1. running groups, in arrival order
        i = 0
        while i < len(running):
            g = running[i]
            seqs = g.seqs
            if len(seqs) == 1:
                s = seqs[0]
                start = s.num_computed_tokens
                tokens = s.token_ids
                pending = s.num_pending_tokens
                known = len(tokens) + pending
                if pending and (known - s.prompt_len >= g._max_tokens or known >= self._max_len):
                    i += 1  # its coming token ends it (LENGTH): nothing to compute
                    continue
                need = known - start
                if need <= budget:
                    t = need
                elif chunked and budget > 0:
                    t = budget
                else:
                    blocked = True
                    break
                cow = allocate_slots(s.seq_id, t, pending)
                while cow is None:  # no free block: preempt the latest arrival, ask again
                    if not self._preempt_latest(g, swap_out, preempted):
                        break
                    cow = allocate_slots(s.seq_id, t, pending)
                if cow is None:
                    break  # g itself was preempted (it was the last running group)
                if cow:
                    copies.extend(cow)
                end = start + t
                s.num_computed_tokens = end
                do_sample = end == known
                num_samples += do_sample
                scheduled.append(
                    ScheduledSequence(
                        s.seq_id,
                        g.request_id,
                        start,
                        t,
                        table_ref(s.seq_id),
                        tokens,
                        t > 1 or start < s.prompt_len,
                        do_sample,
                    )
                )
                seq_objs.append(s)
                budget -= t
            else:
                ts = self._plan([len(s.token_ids) - s.num_computed_tokens for s in seqs], budget)
                if not any(ts):
                    blocked = True
                    break
                if not self._make_room(g, ts, swap_out, preempted):
                    break
                budget, num_samples = self._emit(
                    g, ts, scheduled, seq_objs, copies, budget, num_samples
                )
            i += 1

        # ---- 2. swapped groups come back (not in a step that had to preempt: memory is tight)
        swapped = self._swapped
        if not blocked and not preempted:
            while swapped and budget > 0:
                g = swapped[0]
                if self._running_reserve + g.params.n > self._max_seqs:
                    blocked = True
                    break
                seqs = g.seqs
                ts = self._plan([len(s.token_ids) - s.num_computed_tokens for s in seqs], budget)
                if not any(ts):
                    blocked = True
                    break
                ids = [s.seq_id for s in seqs]
                if running:
                    # Keep the watermark, with an upper bound of what the swap in costs.
                    if bm.num_free_blocks - bm.blocks_needed_to_swap_in(ids, ts) < self._wm:
                        blocked = True
                        break
                elif not bm.can_swap_in(ids):
                    blocked = True
                    break
                mapping = bm.swap_in(ids)
                swap_in.extend(mapping.items())
                swapped.popleft()
                self._to_running(g)
                if bm.group_blocks_needed(ids, ts) <= bm.num_free_blocks:
                    budget, num_samples = self._emit(
                        g, ts, scheduled, seq_objs, copies, budget, num_samples
                    )
                else:  # only when nothing else runs; the running phase ends it next step
                    blocked = True
                    break

        # ---- 3. waiting requests, strictly in arrival order
        if not blocked and not preempted and not swapped:
            waiting = self._waiting
            while waiting and budget > 0:
                g = waiting[0]
                if self._running_reserve + g.params.n > self._max_seqs:
                    break
                ts = self._admit(g, budget)
                if ts is None:
                    break
                waiting.popleft()
                self._to_running(g)
                budget, num_samples = self._emit(
                    g, ts, scheduled, seq_objs, copies, budget, num_samples
                )

        finished = self._finished_pending
        self._finished_pending = []
        out = SchedulerOutput(
            scheduled,
            swap_out,
            swap_in,
            copies,
            self._budget - budget,
            preempted,
            finished,
            seq_objs,
            num_samples,
        )
        self._last_output = out
        return out

    def _plan(self, needs: list[int], budget: int) -> list[int]:
        """Tokens each sequence of a group computes now, given its pending tokens.

        All of them when they fit. Otherwise each sequence holds back its last token (so that
        no sequence of the group samples before the others): with chunked prefill a greedy split
        of the budget, without it a sequence's pending prefix whole or nothing (one sequence
        alone: whole or nothing).
        """
        if sum(needs) <= budget:
            return needs
        out = []
        left = budget
        if self._chunked:
            for n in needs:
                t = n - 1 if n - 1 < left else left
                out.append(t)
                left -= t
        elif len(needs) == 1:
            return [0]
        else:
            for n in needs:
                t = n - 1 if n - 1 <= left else 0
                out.append(t)
                left -= t
        return out

    def _make_room(
        self,
        g: SequenceGroup,
        ts: list[int],
        swap_out: list[tuple[int, int]],
        preempted: list[tuple[str, PreemptionMode]],
    ) -> bool:
        """Preempt the latest-arrived running groups until the block manager says that all of
        ``g``'s sequences can grow by ``ts`` (``group_blocks_needed <= num_free_blocks``).

        Returns False when ``g`` itself had to go (it was the latest) or was ended because it
        does not fit in the KV cache even alone.
        """
        bm = self.block_manager
        ids = [s.seq_id for s in g.seqs]
        while bm.group_blocks_needed(ids, ts) > bm.num_free_blocks:
            if not self._preempt_latest(g, swap_out, preempted):
                return False
        return True

    def _preempt_latest(
        self,
        g: SequenceGroup,
        swap_out: list[tuple[int, int]],
        preempted: list[tuple[str, PreemptionMode]],
    ) -> bool:
        """``g`` needs blocks and none are free: preempt the latest-arrived running group.

        Returns True when that was another group (ask the block manager again), False when it
        was ``g`` itself: then ``g`` is preempted, or ended when it runs alone and so can never
        fit.
        """
        running = self._running
        victim = running[-1]
        if victim is not g:
            self._preempt(victim, swap_out, preempted)
            return True
        if len(running) == 1:
            self._end_for_lack_of_memory(g)
        else:
            self._preempt(g, swap_out, preempted)
        return False

    def _emit(
        self,
        g: SequenceGroup,
        ts: list[int],
        scheduled: list[ScheduledSequence],
        seq_objs: list[Sequence],
        copies: list[tuple[int, int]],
        budget: int,
        num_samples: int,
    ) -> tuple[int, int]:
        """Grow the group's sequences (room was checked) and add them to the batch."""
        bm = self.block_manager
        for s, t in zip(g.seqs, ts):
            if not t:
                continue
            cow = bm.allocate_slots(s.seq_id, t)
            if cow is None:
                raise RuntimeError(
                    f"sequence {s.seq_id}: the block manager refused blocks it said were free"
                )
            if cow:
                copies.extend(cow)
            start = s.num_computed_tokens
            end = start + t
            s.num_computed_tokens = end
            do_sample = end == len(s.token_ids)
            num_samples += do_sample
            scheduled.append(
                ScheduledSequence(
                    s.seq_id,
                    g.request_id,
                    start,
                    t,
                    bm.block_table_ref(s.seq_id),
                    s.token_ids,
                    t > 1 or start < s.prompt_len,
                    do_sample,
                )
            )
            seq_objs.append(s)
            budget -= t
        return budget, num_samples

    def _admit(self, g: SequenceGroup, budget: int) -> list[int] | None:
        """Register a waiting group's sequences with the block manager if its first chunk fits.

        The sequences are registered first, so that each takes its cached prefix (prefix
        caching) and the block manager can say exactly what the first chunk needs
        (``group_blocks_needed``); when it does not fit they are freed again (with prefix caching
        the cached blocks they took go back to the free queue, most recently used). Keeps
        ``watermark`` blocks free unless nothing else runs (then the head of the queue always
        starts, so the queue cannot stall). Returns the plan (tokens per sequence), with each
        sequence's cached prefix counted as computed, or None when it does not fit now.
        """
        bm = self.block_manager
        seqs = g.seqs
        ids = [s.seq_id for s in seqs]
        cached = [bm.allocate(s.seq_id, s.token_ids, extra_key=g.extra_key) for s in seqs]
        ts = self._plan([len(s.token_ids) - c for s, c in zip(seqs, cached)], budget)
        if any(ts):
            need = bm.group_blocks_needed(ids, ts)
            free = bm.num_free_blocks
            if self._running:
                fits = free - need >= self._wm
            else:
                fits = need <= free
            if fits:
                for s, c in zip(seqs, cached):
                    s.num_computed_tokens = c
                return ts
        for i in ids:
            bm.free(i)
        if any(ts) and not self._running:
            # Nothing else holds memory and the first chunk alone does not fit: never will.
            self._end_for_lack_of_memory(g)
        return None

    def _to_running(self, g: SequenceGroup) -> None:
        g.state = _RUNNING
        for s in g.seqs:
            s.status = _RUNNING
        running = self._running
        if not running or running[-1].arrival_index < g.arrival_index:
            running.append(g)
        else:
            insort(running, g, key=_by_arrival)
        self._running_reserve += g.params.n

    def _leave_running(self, g: SequenceGroup) -> None:
        running = self._running
        if running and running[-1] is g:
            running.pop()
        else:
            running.remove(g)
        self._running_reserve -= g.params.n

    def _preempt(
        self,
        g: SequenceGroup,
        swap_out: list[tuple[int, int]],
        preempted: list[tuple[str, PreemptionMode]],
    ) -> None:
        bm = self.block_manager
        mode = self._mode
        if mode is None:
            mode = _SWAP if len(g.seqs) > 1 and self.config.num_cpu_blocks else _RECOMPUTE
        self._leave_running(g)
        ids = [s.seq_id for s in g.seqs]
        if mode is _SWAP:
            if bm.can_swap_out(ids):
                swap_out.extend(bm.swap_out(ids).items())
                g.state = _SWAPPED
                for s in g.seqs:
                    s.status = _SWAPPED
                _insert_by_arrival(self._swapped, g)
                self._num_swap += 1
            else:
                logger.debug("CPU pool full: preempting %r by recompute", g.request_id)
                mode = _RECOMPUTE
        if mode is _RECOMPUTE:
            for s in g.seqs:
                bm.free(s.seq_id)
                s.num_computed_tokens = 0
                s.status = _WAITING
            g.state = _WAITING
            _insert_by_arrival(self._waiting, g)
            self._num_recompute += 1
        g.num_preemptions += 1
        self._num_preemptions += 1
        preempted.append((g.request_id, mode))
        logger.debug("preempted %r by %s", g.request_id, mode.value)

    def _end_for_lack_of_memory(self, g: SequenceGroup) -> None:
        """End a group that cannot fit in the KV cache even with nothing else running."""
        g.reason_text = (
            f"request {g.request_id!r} ended: its {len(g.seqs)} sequences do not fit in the KV "
            f"cache ({self.config.num_gpu_slots} token slots) even alone; give the cache more "
            "memory or lower n / max_tokens"
        )
        logger.warning("%s", g.reason_text)
        for s in list(g.seqs):
            self._finish_seq(s, _LENGTH)
        self._finished_pending.append(g)

    # ================================================================== update
    def update(
        self, output: SchedulerOutput, samples: Mapping[int, SequenceABC[int]]
    ) -> UpdateResult:
        """Apply the sampled tokens of the step that ran ``output``.

        ``samples[seq_id]`` for every scheduled sequence with ``do_sample``: one token appends
        it; several tokens append the first and fork a new sequence for each other one (sharing
        the blocks); an empty list drops the sequence (finished as ABORTED, blocks freed).
        Sequences aborted or finished since ``schedule()`` may be left out (their samples are
        ignored). Then stop conditions: EOS (unless ignore_eos) and stop_token_ids once
        ``min_tokens`` are generated (STOP), max_tokens and the maximum length (LENGTH).
        Raises ValueError and changes nothing on a bad argument.
        """
        if output is not self._last_output:
            raise ValueError(
                "update() needs the SchedulerOutput returned by the latest schedule() call"
            )
        return self._apply(output, samples)

    def _apply(
        self, output: SchedulerOutput, samples: Mapping[int, SequenceABC[int]]
    ) -> UpdateResult:
        """:meth:`update` once the output is known to be the one to apply now."""
        if output.applied:
            raise ValueError("this SchedulerOutput was already passed to update()")
        if not isinstance(samples, Mapping):
            raise ValueError(f"samples must be a mapping seq_id -> token ids, got {samples!r}")
        sched = output.scheduled

        # ---- validate everything first, and list the running sequences with their tokens
        todo: list[tuple[Sequence, SequenceABC[int]]] = []
        matched = 0
        growth: dict[int, tuple[SequenceGroup, int]] | None = None
        for ss, s in zip(sched, output.seqs):
            if not ss.do_sample:
                continue
            toks = samples.get(ss.seq_id)
            if toks is None:
                if s.status is _RUNNING:
                    raise ValueError(
                        f"samples has no entry for sequence {ss.seq_id} (request "
                        f"{ss.request_id!r}), which was scheduled with do_sample=True"
                    )
                continue
            matched += 1
            if s.status is not _RUNNING:
                continue
            tt = type(toks)
            if (
                tt is not list
                and tt is not tuple
                and (isinstance(toks, str | bytes) or not isinstance(toks, SequenceABC))
            ):
                raise ValueError(f"samples[{ss.seq_id}] must be a list of token ids, got {toks!r}")
            if len(toks) != 1:
                if growth is None:
                    growth = {}
                g = s.group
                before = growth.get(id(g))
                growth[id(g)] = (g, (before[1] if before else 0) + len(toks) - 1)
            for tok in toks:
                if type(tok) is not int and (isinstance(tok, bool) or not isinstance(tok, int)):
                    raise ValueError(
                        f"samples[{ss.seq_id}] holds {tok!r}; token ids must be Python ints "
                        "(use .tolist() on tensors)"
                    )
                if tok < 0:
                    raise ValueError(f"samples[{ss.seq_id}] holds a negative token id {tok}")
            todo.append((s, toks))
        if matched != len(samples):
            expected = {ss.seq_id for ss in sched if ss.do_sample}
            extra = sorted(k for k in samples if k not in expected)
            raise ValueError(
                f"samples has entries for sequences {extra[:10]} that were not scheduled with "
                "do_sample=True in this output"
            )
        if growth:
            for g, delta in growth.values():
                if len(g.seqs) + delta > g.params.n:
                    raise ValueError(
                        f"request {g.request_id!r}: the samples would give it "
                        f"{len(g.seqs) + delta} sequences, more than n={g.params.n}"
                    )

        # ---- apply
        output.applied = True
        result = UpdateResult()
        max_len = self._max_len
        generated = 0
        for s, toks in todo:  # each step below changes s (and its forks) only
            n = len(toks)
            if n == 1:
                tok = toks[0]
                tokens = s.token_ids
                tokens.append(tok)  # the only copy: the block manager reads this list
                generated += 1
                # stop checks, inlined (hot path)
                g = s.group
                p = g.params
                n_out = len(tokens) - s.prompt_len
                reason = None
                if n_out >= p.min_tokens:
                    if tok == p.eos_token_id and not p.ignore_eos:
                        reason = _STOP
                    elif tok in g._stop_ids:
                        reason = _STOP
                        s.stop_reason = tok
                if reason is None and (n_out >= g._max_tokens or len(tokens) >= max_len):
                    reason = _LENGTH
                if reason is not None:
                    result.finished_seqs.append(s)
                    if self._finish_seq(s, reason):
                        result.finished_groups.append(g)
            elif n == 0:
                result.finished_seqs.append(s)
                if self._finish_seq(s, _ABORTED):
                    result.finished_groups.append(s.group)
            else:
                generated += n
                self._fork_and_append(s, toks, result)
        self._generation_tokens += generated
        return result

    def _fork_and_append(self, s: Sequence, toks: SequenceABC[int], result: UpdateResult) -> None:
        g = s.group
        bm = self.block_manager
        branches = [(s, toks[0])]
        for tok in toks[1:]:
            cid = self._new_seq_id()
            child_tokens = s.token_ids.copy()  # the child's own list, before either appends
            bm.fork(s.seq_id, cid, child_tokens)
            child = Sequence(
                cid,
                g,
                child_tokens,
                s.prompt_len,
                index=g.next_index,
                num_computed_tokens=s.num_computed_tokens,
                status=_RUNNING,
            )
            g.next_index += 1
            g.seqs.append(child)
            self._seqs[cid] = child
            result.forks.append((s.seq_id, cid))
            branches.append((child, tok))
        for seq, tok in branches:
            seq.token_ids.append(tok)
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                result.finished_seqs.append(seq)
                if self._finish_seq(seq, reason):
                    result.finished_groups.append(g)

    def _stop_reason(self, s: Sequence, tok: int) -> FinishReason | None:
        g = s.group
        p = g.params
        n_out = len(s.token_ids) - s.prompt_len
        if n_out >= p.min_tokens:
            if tok == p.eos_token_id and not p.ignore_eos:
                return _STOP
            if tok in g._stop_ids:
                s.stop_reason = tok
                return _STOP
        if n_out >= g._max_tokens or len(s.token_ids) >= self._max_len:
            return _LENGTH
        return None

    def _finish_seq(self, s: Sequence, reason: FinishReason) -> bool:
        """Finish one sequence, free its blocks; True when this ended its group."""
        bm = self.block_manager
        if bm.has_seq(s.seq_id):
            bm.free(s.seq_id)
        s.status = _FINISHED
        s.finish_reason = reason
        g = s.group
        g.seqs.remove(s)
        g.finished_seqs.append(s)
        del self._seqs[s.seq_id]
        if g.seqs:
            return False
        if g.state is _RUNNING:
            self._leave_running(g)
        elif g.state is _WAITING:
            self._waiting.remove(g)
        elif g.state is _SWAPPED:
            self._swapped.remove(g)
        g.state = _FINISHED
        del self._groups[g.request_id]
        return True

    # ========================================================= outside events
    def finish_sequence(self, seq_id: int, reason: FinishReason | str = FinishReason.STOP) -> bool:
        """End a sequence for a reason found outside the scheduler (a stop string).

        Frees its blocks at once. Returns True when this ended its request (the request is not
        reported again in ``finished``). Raises ValueError for an unknown id or a bad reason;
        a sequence that already finished is left alone (returns False).
        """
        try:
            reason = FinishReason(reason)
        except ValueError:
            raise ValueError(
                f"reason must be 'stop', 'length' or 'aborted', got {reason!r}"
            ) from None
        if reason is _REJECTED:
            raise ValueError("reason 'rejected' is only for requests that can never run")
        s = self._seqs.get(seq_id)
        if s is None:
            if isinstance(seq_id, int) and 0 <= seq_id < self._next_seq_id:
                return False
            raise ValueError(f"unknown sequence id {seq_id!r}")
        return self._finish_seq(s, reason)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state; its GPU and CPU blocks are freed at once.

        Returns False when the request is unknown or already finished. The request is reported
        in the next output's ``finished``.
        """
        g = self._groups.get(request_id)
        if g is None:
            return False
        for s in list(g.seqs):
            self._finish_seq(s, _ABORTED)
        g.finish_reason = _ABORTED
        self._finished_pending.append(g)
        self._num_aborted += 1
        return True

    # ================================================================= queries
    def has_unfinished(self) -> bool:
        """Whether a request is still unfinished, or finished but not yet reported by schedule()."""
        return bool(self._groups) or bool(self._finished_pending)

    def get_group(self, request_id: str) -> SequenceGroup | None:
        """The unfinished request with this id (None when unknown or finished)."""
        return self._groups.get(request_id)

    def get_sequence(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence with this id."""
        return self._seqs.get(seq_id)

    @property
    def running(self) -> tuple[SequenceGroup, ...]:
        """Running groups (they hold GPU blocks), in arrival order: the last is the next victim."""
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[SequenceGroup, ...]:
        """Waiting groups (no blocks: new, or preempted by recompute), in arrival order."""
        return tuple(self._waiting)

    @property
    def swapped(self) -> tuple[SequenceGroup, ...]:
        """Groups swapped out to the CPU pool, in arrival order (they resume first)."""
        return tuple(self._swapped)

    @property
    def num_running(self) -> int:
        """Number of running groups."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Number of waiting groups."""
        return len(self._waiting)

    @property
    def num_swapped(self) -> int:
        """Number of swapped-out groups."""
        return len(self._swapped)

    @property
    def num_unfinished(self) -> int:
        """Requests not finished yet (running, waiting or swapped)."""
        return len(self._groups)

    @property
    def num_preemptions(self) -> int:
        """Group preemptions since the start (recompute and swap)."""
        return self._num_preemptions

    def stats(self) -> SchedulerStats:
        """Counters plus the block manager's :class:`kvblocks.KVStats` (O(blocks in use))."""
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_swapped=len(self._swapped),
            num_running_seqs=sum(len(g.seqs) for g in self._running),
            num_preemptions=self._num_preemptions,
            num_recompute_preemptions=self._num_recompute,
            num_swap_preemptions=self._num_swap,
            num_rejected=self._num_rejected,
            num_aborted=self._num_aborted,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            kv=self.block_manager.stats(),
        )
