"""`EngineCore`: an `LLMEngine` that takes `EngineCoreRequest`s and answers each step with one
`EngineCoreOutputs`, whatever carries them (a ZMQ socket in its own process, or a queue in a
thread for tests and notebooks).

The engine runs with partial outputs off (no `RequestOutput` per running request per step)
and without detokenization (the API process detokenizes); its output processor records each
step's new tokens in a `StepDeltas`, which become the step's message as they are.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import time
from typing import TYPE_CHECKING

from pagedkv.engine.core.messages import (
    CoreStats,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EntryLogprobs,
    FinishedRequest,
    SeqFinish,
)
from pagedkv.engine.output_processor import StepDeltas

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

#: Most often the engine's counters ride along with a step's message: gathering them walks
#: the block pool (milliseconds with tens of thousands of blocks, on the step loop's thread),
#: and /metrics is scraped every few seconds. They are always sent when the engine goes idle.
#: The queue lengths (the batch size) are cheap and go with every step that changes them.
STATS_INTERVAL_S = 0.5


def core_params(params):
    """The `SamplingParams` the core samples with: the user's, without what the API process
    does itself (stop strings, detokenization). A shallow copy: nothing is validated again,
    and the user's object is not changed."""
    if not params.stop and not params.detokenize and not params.include_stop_str_in_output:
        return params
    p = copy.copy(params)
    p.stop = []
    p.detokenize = False
    p.include_stop_str_in_output = False
    return p


def wants_final(params) -> bool:
    """Whether a request's result is more than its streamed tokens (beam search: the core then
    sends its whole final `RequestOutput`, once)."""
    return bool(params.use_beam_search)


class EngineCore:
    """The step loop's body: add, abort, step -> one `EngineCoreOutputs`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        engine.emit_partial_outputs = False
        self._deltas = StepDeltas()
        engine.outputs.deltas = self._deltas
        self._final_wanted: set[str] = set()
        self._prompt_lp_wanted: dict[str, int] = {}  # request id -> prompt length
        self._queued: dict[str, float] = {}
        self._rejected: list[tuple[str, str]] = []
        self._last_stats = 0.0
        self._stats_dirty = True
        self._queues_sent = (0, 0, 0)

    def ready_message(self) -> EngineCoreReady:
        e = self.engine
        mc = e.model_config
        runner = e.runner
        return EngineCoreReady(
            name=str(mc.name), max_model_len=int(mc.max_model_len), vocab_size=int(mc.vocab_size),
            eos_token_ids=list(e.eos_token_ids),
            kv_capacity=int(runner.num_gpu_blocks) * e.args.block_size,
            max_num_seqs=e.args.max_num_seqs, block_size=e.args.block_size,
            num_gpu_blocks=int(runner.num_gpu_blocks), num_cpu_blocks=int(runner.num_cpu_blocks),
            device=str(e.device), pid=os.getpid(),
        )

    # ---- inputs ---------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest, params=None) -> None:
        """Queue a request (`params`: the unpickled `SamplingParams`, when the caller has
        them). A request the engine refuses is reported in the next message's `rejected`."""
        if params is None:
            params = req.sampling_params()
        now = time.time()
        try:
            prep = self.engine.prepare_request(req.prompt_token_ids, params)
            # The engine's arrival time is the core's: its queue time is its own.
            self.engine.add_prepared_request(req.request_id, prep, now)
        except ValueError as exc:
            self._rejected.append((req.request_id, str(exc)))
            return
        self._queued[req.request_id] = now
        if wants_final(params):
            self._final_wanted.add(req.request_id)
        if params.prompt_logprobs is not None:
            self._prompt_lp_wanted[req.request_id] = len(prep.prompt_token_ids)
        self._stats_dirty = True

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        self._stats_dirty = True

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Run one engine step; its message (maybe empty: see `EngineCoreOutputs.is_empty`)."""
        finished_outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        d = self._deltas.take()
        msg = EngineCoreOutputs(
            request_ids=d.request_ids, seq_indices=d.seq_indices, token_ids=d.token_ids,
        )
        if d.finishes:
            msg.seq_finishes = [SeqFinish(i, r, s) for i, r, s in d.finishes]
        if d.logprobs:
            msg.logprobs = [
                EntryLogprobs(i, lp.logprob, lp.rank, lp.top_token_ids, lp.top_logprobs)
                for i, lp in d.logprobs
            ]
        if self._prompt_lp_wanted:
            msg.prompt_logprobs = self._complete_prompt_logprobs(finished_outputs)
        if finished_outputs:
            msg.finished = [self._finished(out) for out in finished_outputs]
            self._stats_dirty = True
        if self._rejected:
            msg.rejected, self._rejected = self._rejected, []
        now = time.time()
        idle = not self.engine.has_unfinished_requests()
        if (idle and self._stats_dirty) or now - self._last_stats >= STATS_INTERVAL_S:
            msg.stats = self.stats()
        else:
            sched = self.engine.scheduler
            queues = (sched.num_running, sched.num_waiting, sched.num_swapped)
            if queues != self._queues_sent:
                msg.queues = self._queues_sent = queues
        msg.timestamp = now
        return msg

    def idle_message(self) -> EngineCoreOutputs | None:
        """What to send while idle: refusals and counters not sent yet, or None."""
        if not self._rejected and not self._stats_dirty:
            return None
        msg = EngineCoreOutputs(stats=self.stats(), timestamp=time.time())
        if self._rejected:
            msg.rejected, self._rejected = self._rejected, []
        return msg

    def stats(self) -> CoreStats:
        self._last_stats = time.time()
        self._stats_dirty = False
        stats = CoreStats.of(self.engine.get_stats())
        self._queues_sent = (stats.num_running, stats.num_waiting, stats.num_swapped)
        return stats

    def _complete_prompt_logprobs(self, finished_outputs) -> list[tuple[str, bytes]]:
        """Prompt logprobs that became complete in this step (or ended with their request)."""
        done = []
        of = self.engine.outputs.prompt_logprobs_of
        for rid, n in list(self._prompt_lp_wanted.items()):
            lps = of(rid)
            if lps is not None and len(lps) >= n:
                done.append((rid, pickle.dumps(list(lps), protocol=5)))
                del self._prompt_lp_wanted[rid]
        for out in finished_outputs:
            if self._prompt_lp_wanted.pop(out.request_id, None) is not None:
                lps = out.prompt_logprobs
                if lps is not None:
                    done.append((out.request_id, pickle.dumps(list(lps), protocol=5)))
        return done

    def _finished(self, out) -> FinishedRequest:
        rid = out.request_id
        m = out.metrics
        queued = self._queued.pop(rid, 0.0)
        final = None
        if rid in self._final_wanted:
            self._final_wanted.discard(rid)
            final = pickle.dumps(out, protocol=5)
        aborted = bool(out.outputs) and all(c.finish_reason == "abort" for c in out.outputs)
        stop = [(c.index, c.finish_reason, c.stop_reason if isinstance(c.stop_reason, int | str)
                 else None) for c in out.outputs]
        return FinishedRequest(
            rid, aborted or not out.outputs, stop, queued,
            m.first_scheduled_time if m else None, m.first_token_time if m else None, final,
        )
