"""Honest timings: warm-up runs that are not counted, repeats, the median and the spread.

On a GPU the clock is a pair of CUDA events around the work (device time, what the kernels
took); on the CPU it is the host's ``perf_counter``. A shared CPU is noisy: the notebooks give
token and block counts as their primary figures and call two timings different only when the
middle halves of their samples do not overlap (:meth:`Timing.clearly_below`): one slow outlier
(another job on the machine) does not decide.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any


def _num(x: float) -> str:
    """Three significant digits, never in exponent form."""
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1000 else f"{x:,.0f}"


@dataclass(slots=True, frozen=True)
class Timing:
    """Seconds of each timed repeat (warm-up runs excluded) and the clock that measured them."""

    samples: tuple[float, ...]
    clock: str  # "CUDA events" or "host clock"

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        return min(self.samples)

    @property
    def high(self) -> float:
        return max(self.samples)

    def quartiles(self) -> tuple[float, float]:
        """The lower and the upper quartile: the middle half of the samples lies between
        (with fewer than four samples there is no middle half: the whole range)."""
        if len(self.samples) < 4:
            return self.low, self.high
        lower, _, upper = statistics.quantiles(self.samples, n=4, method="inclusive")
        return lower, upper

    def clearly_below(self, other: Timing) -> bool:
        """The middle half of this one's samples is faster than the middle half of ``other``'s
        (their interquartile ranges do not overlap). Whole ranges would let a single slow run,
        common on a shared CPU, make two clearly different timings look alike."""
        return self.quartiles()[1] < other.quartiles()[0]

    def ms(self) -> str:
        """``"1.23 ms (1.10–1.41, 5 runs)"``: the median, then the range, in one unit."""
        scale, unit = (1e6, "µs") if self.high < 1e-3 else (1e3, "ms") if self.high < 10 else (1, "s")
        return (
            f"{_num(self.median * scale)} {unit} ({_num(self.low * scale)}–"
            f"{_num(self.high * scale)}, {len(self.samples)} runs)"
        )

    def __str__(self) -> str:
        return self.ms()


def time_it(
    fn: Callable[[], Any], device, *, warmup: int = 1, repeats: int = 5
) -> Timing:
    """Run ``fn`` ``warmup`` times untimed (first calls compile kernels, fill caches), then
    ``repeats`` times, each timed on its own; a ValueError for counts that make no sense."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return Timing(tuple(samples), "CUDA events")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Timing(tuple(samples), "host clock")


def time_interleaved(
    fns: Mapping[Hashable, Callable[[], Any]], device, *, warmup: int = 1, repeats: int = 5
) -> dict[Hashable, Timing]:
    """Like :func:`time_it` for several functions, their repeats taken in turns (round robin),
    so that a machine whose load changes over time slows all of them alike."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[Hashable, list[float]] = {key: [] for key in fns}
    clock = "host clock"
    for _ in range(repeats):
        for key, fn in fns.items():
            t = time_it(fn, device, warmup=0, repeats=1)
            samples[key].append(t.samples[0])
            clock = t.clock
    return {key: Timing(tuple(s), clock) for key, s in samples.items()}
