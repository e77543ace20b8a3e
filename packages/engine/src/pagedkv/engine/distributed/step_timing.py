"""Where each tensor-parallel rank spends its steps: the numbers that tell whether a rank lags.

The ranks meet in every all-reduce of a pass, so a pass lasts as long as the last rank takes to
reach each of them. A worker that launches its pass late makes rank 0's GPU wait inside the
first all-reduce, and rank 0's own timers (``ModelRunner.step_gpu_events``) count that wait as
GPU work. So with ``PAGEDKV_TP_DIAG=1`` in the environment (spawned workers and torchrun ranks
inherit it) every rank records, per step:

* the kind of pass: a decode replaying a CUDA graph, a decode run eagerly, a prefill or mixed
  pass (always eager), and its batch-size band;
* ``wait``: a worker's time blocked waiting for the driver's message (0 on the driver);
* ``host``: the driver's encoding and sending of the message plus its launch of the pass; a
  worker's decoding of the message plus its launch;
* ``sync``: how long this rank's device waited, at the start of the step, for the other ranks
  to get there: a one-element all-reduce before the pass, timed with CUDA events on a GPU
  (with the host clock on the CPU, where gloo blocks the host);
* ``gpu``: the pass's device time after that all-reduce, when every rank has started it
  (CUDA events; GPUs only).

A rank whose ``sync`` is large waits for another; the rank that lags has ``sync`` near 0 and
usually its ``host`` or ``wait`` tells why. Off (the default) nothing is recorded and no extra
collective runs. Summaries are read over the CPU group (`TensorParallelRunner.rank_timings`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DIAG_ENV = "PAGEDKV_TP_DIAG"
# Batch-size bands, as `pagedkv bench throughput` reports host wait.
BANDS = ((1, 64), (65, 256), (257, 512), (513, 1024), (1025, 1 << 30))
_MAX_STEPS = 200_000  # a long-running server keeps the latest steps only


def diag_enabled() -> bool:
    """Whether ``PAGEDKV_TP_DIAG`` asks for per-step timings (any value but empty or 0)."""
    return os.environ.get(DIAG_ENV, "").strip() not in ("", "0")


def band_of(num_seqs: int) -> str:
    for low, high in BANDS:
        if num_seqs <= high:
            return f"{low}-{high}" if high < 1 << 30 else f"{low}+"
    raise AssertionError("unreachable")


@dataclass(slots=True)
class _Step:
    kind: str  # "decode-graph", "decode-eager", "prefill/mixed"
    num_seqs: int
    wait_s: float
    host_s: float
    sync: Any  # seconds (CPU) or (start, after_sync, end) CUDA events; None when not probed
    gpu_s: float | None = None


class StepTimings:
    """One rank's per-step record (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._probe = torch.zeros(1, dtype=torch.float32, device=device)
        self._steps: deque[_Step] = deque(maxlen=_MAX_STEPS)

    def start(self) -> Any:
        """At the start of a step, before its block operations: wait for the other ranks in a
        one-element all-reduce on the device group. Returns what `finish` needs."""
        if self._cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            dist.all_reduce(self._probe)
            synced = torch.cuda.Event(enable_timing=True)
            synced.record()
            return begin, synced
        t0 = time.perf_counter()
        dist.all_reduce(self._probe)
        return time.perf_counter() - t0

    def finish(self, started: Any, kind: str, num_seqs: int, wait_s: float, host_s: float
               ) -> None:
        """After the pass is launched: record the step."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            started = (*started, end)
        self._steps.append(_Step(kind, num_seqs, wait_s, host_s, started))

    def summary(self, reset: bool = True) -> dict[str, dict[str, Any]]:
        """Per "kind band" (e.g. "decode-graph 257-512"): steps, and the median and 90th
        percentile, in ms, of wait, host, sync (and gpu on a GPU). Waits for the device
        first. With `reset`, the next summary covers the steps after this one only."""
        if self._cuda and self._steps:
            torch.cuda.synchronize(self.device)
        groups: dict[str, list[_Step]] = {}
        for s in self._steps:
            if self._cuda and isinstance(s.sync, tuple):
                begin, synced, end = s.sync
                s.sync = begin.elapsed_time(synced) / 1e3
                s.gpu_s = synced.elapsed_time(end) / 1e3
            groups.setdefault(f"{s.kind} {band_of(s.num_seqs)}", []).append(s)
        if reset:
            self._steps.clear()
        out: dict[str, dict[str, Any]] = {}
        for key in sorted(groups, key=_order):
            steps = groups[key]
            row: dict[str, Any] = {"steps": len(steps)}
            for name in ("wait", "host", "sync", "gpu"):
                attr = "sync" if name == "sync" else f"{name}_s"
                vals = [getattr(s, attr) for s in steps]
                vals = [v for v in vals if isinstance(v, float)]
                if vals:
                    row[f"{name}_ms"] = _stats_ms(vals)
            out[key] = row
        return out


def _stats_ms(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    return {"median": 1e3 * statistics.median(values), "p90": 1e3 * p90,
            "total": 1e3 * sum(values)}


def _order(key: str) -> tuple[str, int]:
    kind, band = key.rsplit(" ", 1)
    return kind, int(band.split("-")[0].rstrip("+"))


def format_rank_timings(timings: list[dict[str, dict[str, Any]]]) -> str:
    """A table of `rank_timings()`: one line per rank and kind band, medians (p90) in ms."""
    lines = [f"{'rank':>4}  {'pass':<26} {'steps':>6}  {'wait':>15}  {'host':>15}  "
             f"{'sync':>15}  {'gpu':>15}"]
    for rank, summary in enumerate(timings):
        for key, row in summary.items():
            cells = []
            for name in ("wait", "host", "sync", "gpu"):
                v = row.get(f"{name}_ms")
                cells.append(f"{v['median']:7.3f} ({v['p90']:6.2f})" if v else f"{'-':>15}")
            lines.append(f"{rank:>4}  {key:<26} {row['steps']:>6}  " + "  ".join(cells))
    return "\n".join(lines)
