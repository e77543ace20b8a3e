"""Asynchronous scheduling: the host prepares step N+1 while the device runs step N.

On a GPU a decode step of a large batch is a CUDA-graph replay of a few milliseconds, and the
plain step leaves the GPU idle while the host applies the step's tokens, detokenizes and
schedules the next batch. Here, for batches of plain greedy requests, one `step()` does:

```
out = scheduler.schedule_ahead()     # step N+1, built before step N's tokens are known:
                                     # each sequence is scheduled at its coming token's position
launched = runner.execute_async(out) # its input tokens are read on the device from N's argmax
result = in_flight.result()          # only now wait for step N's tokens...
scheduler.update(...); outputs(...)  # ...and apply them while N+1 runs
```

Greedy requests under token masks (structured output, `allowed_token_ids`, `bad_words`) take
part too: their rows' argmax waits on the host for the masks, which need step N's tokens, so
the runner launches N+1's forward pass and logits, and `finish()` builds the masks and takes
the masked argmax once N is applied, while N+1's forward pass runs.

Whenever that does not hold — a request that samples, wants logprobs or beams, a lack of
free blocks, swapped requests, prefix caching (see `Scheduler.can_schedule_ahead`) — the step
in flight is applied first and the engine takes the plain step.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

from pagedkv.engine.distributed.executor import TensorParallelError
from pagedkv.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine


class AsyncScheduling:
    """The engine's step with one batch in flight (see the module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        # The engine owns this strategy: a proxy keeps the pair out of a reference cycle, so
        # dropping an engine frees its weights and KV cache at once, not at the next garbage
        # collection (a second engine in the same process would not fit on the GPU meanwhile).
        self.engine = weakref.proxy(engine)
        # (SchedulerOutput, worker.model_runner.InFlightStep, the block tables it launched with
        # when observed: kvblocks' lists grow again when the next step is scheduled ahead)
        self.in_flight = None

    def step(self) -> list[RequestOutput]:
        """Launch the next pass, then apply the one in flight."""
        engine = self.engine
        sched = engine.scheduler
        results: list[RequestOutput] = []
        prev, self.in_flight = self.in_flight, None
        t0 = time.perf_counter()
        if prev is not None and self._greedy_batch() and sched.can_schedule_ahead():
            out = sched.schedule_ahead()
        else:
            if prev is not None:
                results += self._apply(prev)
                prev = None
            if not self._greedy_batch():  # sampling, logprobs, beams...: the plain step
                return results + engine.plain_step()
            out = sched.schedule()
        now = time.time()
        results += engine.outputs.finished_outside(out.finished, now)
        t1 = time.perf_counter()
        if not out.is_empty:
            try:
                tables = [tuple(ss.block_table) for ss in out.scheduled] if engine.observed else None
                launched = engine.runner.execute_async(out)
                # (schedule, launch) of this pass: reported with the step applied next to it
                self.in_flight = (out, launched, tables, (t1 - t0, time.perf_counter() - t1))
            except TensorParallelError as exc:  # a rank died: no step can run any more
                engine.fail(exc)
                raise
            except Exception:
                if prev is not None:
                    results += self._apply(prev)
                engine.abort_batch(out)
                return results
            engine.outputs.note_scheduled(out, now)
        if prev is not None:
            results += self._apply(prev, self.in_flight)
        if self.in_flight is not None:
            # Token masks (structured output) need the tokens just applied: they are built now,
            # while the pass launched above still runs on the device.
            try:
                self.in_flight[1].finish()
            except Exception:  # a mask that could not be built: that batch ends, not the engine
                failed, self.in_flight = self.in_flight, None
                engine.abort_batch(failed[0])
                return results
        if self.in_flight is not None and not sched.has_unfinished():
            # Every request ended with the step just applied: the pass in flight only computed
            # rows to be ignored. Apply it now, so that the scheduler is idle between calls.
            last, self.in_flight = self.in_flight, None
            results += self._apply(last)
        return results

    def _greedy_batch(self) -> bool:
        """Whether every live request takes an argmax: plain greedy, or greedy under token masks
        (structured output) when the runner can mask a pass in flight."""
        outputs = self.engine.outputs
        return outputs.all_argmax or (outputs.all_greedy
                                      and getattr(self.engine.runner, "masks_in_flight", False))

    def _apply(self, in_flight, launched_next=None) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them. Requests that ended since it was
        launched (aborted, or stopped by the step before) are skipped by `update`.
        `launched_next`: the pass launched since (its schedule and launch times are traced with
        this step)."""
        engine = self.engine
        out, launched, tables, _ = in_flight
        t0 = time.perf_counter()
        try:
            result = launched.result()
        except TensorParallelError as exc:
            engine.fail(exc)
            raise
        samples = result.sampled_token_ids
        t1 = time.perf_counter()
        update = engine.scheduler.update(out, samples)
        t2 = time.perf_counter()
        results = engine.outputs.process(out, result, samples, update, time.time())
        if engine.observed:
            timings = {}
            if launched_next is not None:
                timings["schedule"], timings["launch"] = launched_next[3]
            engine.observe(out, samples, update, results, tables=tables, wait=t1 - t0,
                           update=t2 - t1, output=time.perf_counter() - t2, **timings)
        return results
