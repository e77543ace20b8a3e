"""`PhaseClock`: host time per phase of an engine step, for the measuring scripts here
(`host_overhead.py`, `step_profile.py`, `gpu_structured_output.py`).

It replaces methods (of an instance, a class or a module) by wrappers that add each call's
`time.perf_counter` span to a phase, so that the engine's own code calls the wrappers. Import
it from a script run as `python scripts/<name>.py` (the scripts folder is on `sys.path`).
"""

from __future__ import annotations

import functools
import time


class PhaseClock:
    """Seconds per phase since the last `take()` (phases named in `phases` start at 0)."""

    def __init__(self, phases: tuple[str, ...] = ()) -> None:
        self.acc: dict[str, float] = dict.fromkeys(phases, 0.0)

    def wrap(self, obj, name: str, phase: str) -> None:
        """Time every call of `obj.name` (a method or a module function) into `phase`; nothing
        when `obj` has no such attribute (an engine without asynchronous scheduling, say)."""
        fn = getattr(obj, name, None)
        if fn is None:
            return
        acc = self.acc
        clock = time.perf_counter

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                acc[phase] = acc.get(phase, 0.0) + clock() - t0

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        """The seconds per phase so far; the phases restart at 0."""
        out = dict(self.acc)
        for k in self.acc:
            self.acc[k] = 0.0
        return out
