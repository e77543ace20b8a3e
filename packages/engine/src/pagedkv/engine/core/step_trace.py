"""A trace of the engine core's steps: where the time of a served token goes.

A client sees a served request's time per output token (TPOT); the engine core sees steps.
With `PAGEDKV_STEP_TRACE=<path>` in its environment the engine core process appends one JSON
line per step to `<path>`: when the step ended (`t`, the wall clock, comparable with the
benchmark client's), how many sequences decoded, how many prompt tokens it computed (prefill
chunks riding along), the queue lengths after it, and its phases in milliseconds (`schedule`,
`execute`, `update`, `output` for a plain step; `wait`, `update`, `output` for a step
scheduled asynchronously). `pagedkv.bench.step_trace` summarizes a trace per benchmark rate:
decode-only steps against steps that carry a prefill, and how many ran asynchronously.

The trace is a step observer: each step then builds a `StepRecord` (a copy of the scheduled
sequences' block tables), a little host time, so trace a run to explain it, not to time it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import IO

from pagedkv.engine.step_record import StepRecord

logger = logging.getLogger(__name__)

#: The environment variable that turns the trace on (a file path).
ENV_VAR = "PAGEDKV_STEP_TRACE"


class StepTrace:
    """A step observer that writes one JSON line per step (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = open(path, "a", buffering=1 << 16)  # noqa: SIM115

    def __call__(self, record: StepRecord) -> None:
        if self._file is None:
            return
        decode = prefill_tokens = 0
        for s in record.scheduled:
            if s.is_prefill:
                prefill_tokens += s.num_tokens
            else:
                decode += 1
        line = {"t": round(time.time(), 6), "step": record.step, "decode": decode,
                "prefill_tokens": prefill_tokens, "running": record.num_running,
                "waiting": record.num_waiting}
        for phase, seconds in record.timings.items():
            line[phase] = round(seconds * 1e3, 4)
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def trace_from_env(engine) -> StepTrace | None:
    """Attach a `StepTrace` to `engine` when `PAGEDKV_STEP_TRACE` names a file."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    trace = StepTrace(path)
    engine.add_step_observer(trace)
    logger.info("tracing every step to %s (%s)", path, ENV_VAR)
    return trace
