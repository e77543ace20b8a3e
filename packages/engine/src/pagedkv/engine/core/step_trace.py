"""A trace of the engine core's steps: where the time of a served token goes.

A client sees a served request's time per output token (TPOT); the engine core sees steps.
With `PAGEDKV_STEP_TRACE=<path>` in its environment the engine core process appends one JSON
line per step to `<path>`: when the step ended (`t`, the wall clock, comparable with the
benchmark client's), how many sequences decoded, how many prompt tokens it computed (prefill
chunks riding along), the queue lengths after it, and its phases in milliseconds (`schedule`,
`execute`, `update`, `output` for a plain step; `wait`, `update`, `output` for a step
scheduled asynchronously, with `schedule` and `launch` of the pass launched in the same
iteration), and the loop's `inputs` (reading requests and aborts) and `send` (the step's
message) before it. `pagedkv.bench.step_trace` summarizes a trace per benchmark rate:
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
        #: The step loop's own phases since the last line (milliseconds: reading requests and
        #: aborts, sending the step's message), written with the next line.
        self.loop: dict[str, float] = {}

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
        if self.loop:
            line.update(self.loop)
            self.loop = {}
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


#: `PAGEDKV_CORE_PROFILE=<path>[:<skip>[:<count>]]`: profile `count` loop iterations of the
#: engine core (default 150) after `skip` ones with work (default 2,000) with torch.profiler,
#: then write the report (`profile_report`) to `<path>` and its Chrome trace to `<path>.json`.
PROFILE_ENV_VAR = "PAGEDKV_CORE_PROFILE"


class CoreProfile:
    """torch.profiler over a window of the engine core's loop (see `PROFILE_ENV_VAR`)."""

    def __init__(self, spec: str) -> None:
        path, _, rest = spec.partition(":")
        skip, _, count = rest.partition(":")
        self.path = path
        self.skip = int(skip or 2000)
        self.count = int(count or 150)
        self._seen = 0
        self._prof = None

    def tick(self) -> None:
        """Call once per loop iteration that stepped."""
        self._seen += 1
        if self._seen == self.skip:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
        elif self._seen == self.skip + self.count and self._prof is not None:
            self.close()

    def close(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        with open(self.path, "w") as f:
            f.write(profile_report(prof))
        prof.export_chrome_trace(self.path + ".json")
        logger.info("profiled %d engine-core iterations: %s", self.count, self.path)


def profile_from_env() -> CoreProfile | None:
    spec = os.environ.get(PROFILE_ENV_VAR)
    return CoreProfile(spec) if spec else None


def profile_report(prof, top: int = 60) -> str:
    """The longest single host calls of a torch.profiler run (each name at most 4 times),
    then the table of all calls by total host time."""
    import torch

    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    lines = ["longest single host calls (us):"]
    seen: dict[str, int] = {}
    for e in sorted(events, key=lambda e: e.cpu_time_total, reverse=True):
        n = seen.get(e.name, 0)
        if n >= 4:
            continue
        seen[e.name] = n + 1
        lines.append(f"{e.cpu_time_total:10.0f}  {e.name[:90]}")
        if len(lines) > top:
            break
    lines.append(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40,
                                           max_name_column_width=70))
    return "\n".join(lines) + "\n"
