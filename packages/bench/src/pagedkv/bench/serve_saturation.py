"""Below saturation: how a `bench serve --request-rates` sweep runs before the server falls
behind. The batch the server ran at (sampled from its /metrics while a rate runs), the knee of
the sweep, and median TPOT against the offline engine's decode step at the same batch size
(measured by `pagedkv.bench.decode_step` after the server stops).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
from typing import Any

import httpx

from pagedkv.bench.serve_report import fmt, rate_label
from pagedkv.bench.serve_requests import RequestResult

#: A rate *follows its offered load* when the normalized latency (s/token) of its last third of
#: requests, in arrival order, is at most this many times that of its first third. A server
#: that keeps up serves the late requests as it served the early ones; past the knee a backlog
#: (a queue, or a batch that keeps growing) builds up over the run, so the late requests wait.
#: Why not achieved / offered throughput: a run of a few hundred requests ends with a drain
#: (the last long requests, up to ~1,900 tokens for ShareGPT) of many seconds whatever the
#: load, which pulls that ratio far below 1 even where the server keeps up.
DEFAULT_KNEE_LATENCY_GROWTH = 1.5
#: The goals below the knee: median TPOT within 1.3x the offline decode step at the same
#: batch size, and P99 inter-token latency within 100 ms.
TPOT_OVER_DECODE_STEP_GOAL = 1.3
P99_ITL_MS_GOAL = 100.0

_RUNNING_GAUGE = "vllm:num_requests_running"
_WAITING_GAUGE = "vllm:num_requests_waiting"

#: Per-rate figures of this module (the sweep's last JSON line carries them too).
SATURATION_KEYS = (
    "num_requests",
    "p99_itl_ms",
    "offered_output_tok_s",
    "batch_size_median",
    "batch_size_mean",
    "batch_size_max",
    "waiting_max",
    "latency_growth",
    "follows_offered_load",
    "offline_decode_step_ms",
    "tpot_over_decode_step",
    "started_at",  # wall clock (time.time()) when the rate's first request was due
    "ended_at",  # and when its last response ended: the span of the rate in a step trace
)


def add_saturation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "below saturation (sweeps)",
        "the batch the server ran at, from its /metrics, and the knee of the sweep",
    )
    g.add_argument(
        "--metrics-period",
        type=float,
        default=0.2,
        metavar="S",
        help="while a rate runs, read the server's /metrics every S seconds for "
        f"{_RUNNING_GAUGE} (the batch size) and {_WAITING_GAUGE}; 0: do not (default 0.2)",
    )
    g.add_argument(
        "--duration-per-rate",
        type=float,
        default=None,
        metavar="S",
        help="send each rate the first rate x S of the --num-prompts requests (about S seconds "
        "of arrivals; all of them when fewer), so that high rates run long enough to build a "
        "backlog and low rates do not take minutes (default: all requests at every rate)",
    )
    g.add_argument(
        "--knee-latency-growth",
        type=float,
        default=DEFAULT_KNEE_LATENCY_GROWTH,
        metavar="X",
        help="a rate follows its offered load when its last third of requests' normalized "
        "latency is at most X times its first third's; the knee is the highest rate that, "
        f"with every lower one, does (default {DEFAULT_KNEE_LATENCY_GROWTH})",
    )


def check_saturation(args: argparse.Namespace) -> None:
    if not (args.metrics_period >= 0 and math.isfinite(args.metrics_period)):
        raise ValueError("--metrics-period must be >= 0 seconds (0: no sampling)")
    if not (args.knee_latency_growth >= 1 and math.isfinite(args.knee_latency_growth)):
        raise ValueError("--knee-latency-growth must be a finite factor >= 1 (e.g. 1.5)")
    if args.duration_per_rate is not None:
        if not (args.duration_per_rate > 0 and math.isfinite(args.duration_per_rate)):
            raise ValueError("--duration-per-rate must be a finite number of seconds > 0")
        if args.request_rates is None:
            raise ValueError("--duration-per-rate goes with --request-rates (a sweep)")


def parse_gauges(text: str) -> tuple[float | None, float | None]:
    """(running, waiting) from a Prometheus text page (summed over label sets); None for a
    gauge the page lacks."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{")[0]
        if name in (_RUNNING_GAUGE, _WAITING_GAUGE):
            try:
                found[name] = found.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return found.get(_RUNNING_GAUGE), found.get(_WAITING_GAUGE)


async def sample_gauges(
    client: httpx.AsyncClient,
    base: str,
    period: float,
    out: list[tuple[float, float | None]],
    stop: asyncio.Event,
) -> None:
    """Append (running, waiting) every `period` seconds until `stop`; a failed read is
    skipped (a server without /metrics gives no samples)."""
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            resp = await client.get(base + "/metrics", timeout=5.0)
            if resp.status_code == 200:
                running, waiting = parse_gauges(resp.text)
                if running is not None:
                    out.append((running, waiting))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period)


def rate_requests(num_prompts: int, rate: float, duration: float | None) -> int:
    """How many of the sweep's requests a rate sends: all, or about `duration` seconds of
    arrivals (at least one)."""
    if duration is None:
        return num_prompts
    return max(1, min(num_prompts, math.ceil(rate * duration)))


def token_weighted_median(values: list[float]) -> float | None:
    """The batch size the median output token was generated in: the median of equally spaced
    samples of the running batch, each weighted by its value (a batch of B makes B tokens a
    step). None without a sample of a non-empty batch."""
    total = sum(v for v in values if v > 0)
    if total <= 0:
        return None
    acc = 0.0
    ordered = sorted(v for v in values if v > 0)
    for v in ordered:
        acc += v
        if acc >= total / 2:
            break
    return v


def latency_growth(results: list[RequestResult]) -> float | None:
    """Median normalized latency (e2e / output tokens) of the last third of the completed
    requests, in arrival order (`results` is), over that of the first third; None with fewer
    than three."""
    per_token = [r.e2e / r.output_tokens for r in results if r.ok and r.output_tokens > 0]
    third = len(per_token) // 3
    if third == 0:
        return None
    early = statistics.median(per_token[:third])
    late = statistics.median(per_token[-third:])
    return late / early if early > 0 else None


def rate_saturation(
    results: list[RequestResult],
    samples: list[tuple[float, float | None]],
    offered_output_tok_s: float,
    max_growth: float,
) -> dict[str, Any]:
    """The per-rate figures of `SATURATION_KEYS` that the sweep measures itself."""
    running = [r for r, _ in samples]
    waiting = [w for _, w in samples if w is not None]
    median = token_weighted_median(running)
    growth = latency_growth(results)
    failed = sum(not r.ok for r in results)
    return {
        "offered_output_tok_s": offered_output_tok_s,
        "batch_size_median": None if median is None else round(median),
        "batch_size_mean": statistics.fmean(running) if running else None,
        "batch_size_max": int(max(running)) if running else None,
        "waiting_max": int(max(waiting)) if waiting else None,
        "metrics_samples": len(samples),
        "latency_growth": growth,
        "follows_offered_load": _follows(growth, failed, len(results) - failed, max_growth),
    }


def _follows(growth: float | None, failed: int, completed: int, max_growth: float) -> bool | None:
    if failed or not completed:
        return False
    return None if growth is None else growth <= max_growth


def knee_summary(per_rate: list[dict[str, Any]], max_growth: float) -> dict[str, Any]:
    """The knee of a sweep: the highest rate that, with every lower rate tested, follows its
    offered load (see `DEFAULT_KNEE_LATENCY_GROWTH`); a rate that cannot be judged (fewer than
    three requests) ends the run of rates like one that does not follow. `status`: "crossed",
    "all_rates_follow" (the knee is at least the highest rate: test higher ones) or
    "lowest_rate_saturated" (test lower ones)."""
    if not per_rate:
        raise ValueError("a knee needs at least one rate's results")
    if not (max_growth >= 1 and math.isfinite(max_growth)):
        raise ValueError(f"the latency growth bound must be a finite factor >= 1 (got {max_growth})")
    ordered = sorted(per_rate, key=lambda s: s["request_rate"])
    knee: float | None = None
    first_past: float | None = None
    for s in ordered:
        ok = _follows(s.get("latency_growth"), s["failed"], s["completed"], max_growth)
        if ok is not True:
            first_past = float(s["request_rate"])
            break
        knee = float(s["request_rate"])
    if knee is None:
        status = "lowest_rate_saturated"
        note = (f"even the lowest rate, {rate_label(ordered[0]['request_rate'])} req/s, falls behind "
                "its offered load (or fails requests): test lower rates")
    elif first_past is None:
        status = "all_rates_follow"
        note = (f"every rate up to the highest tested, {rate_label(knee)} req/s, follows its offered "
                "load: the knee is at least that; test higher rates")
    else:
        status = "crossed"
        note = (f"knee {rate_label(knee)} req/s: the server keeps up to it and falls behind at "
                f"{rate_label(first_past)} req/s")
    return {"knee_rate": knee, "status": status, "first_rate_past_knee": first_past,
            "latency_growth_bound": max_growth, "note": note}


def attach_decode_steps(per_rate: list[dict[str, Any]], step_ms: dict[int, float]) -> None:
    """Give each rate whose batch size has an offline decode step time (ms, by batch size)
    `offline_decode_step_ms` and `tpot_over_decode_step` (median TPOT over it)."""
    for s in per_rate:
        batch = s.get("batch_size_median")
        if batch is None or batch not in step_ms:
            continue
        s["offline_decode_step_ms"] = step_ms[batch]
        if step_ms[batch] > 0 and s.get("median_tpot_ms"):
            s["tpot_over_decode_step"] = s["median_tpot_ms"] / step_ms[batch]


def saturation_record(per_rate: list[dict[str, Any]], max_growth: float) -> dict[str, Any]:
    """The sweep JSON's top-level figures of this module: the knee and the worst TPOT ratio and
    P99 ITL of the rates up to it, with the goals below the knee."""
    knee = knee_summary(per_rate, max_growth)
    below = [s for s in per_rate
             if knee["knee_rate"] is not None and s["request_rate"] <= knee["knee_rate"]]
    ratios = [s["tpot_over_decode_step"] for s in below if s.get("tpot_over_decode_step")]
    itls = [s["p99_itl_ms"] for s in below if s.get("p99_itl_ms") is not None]
    tpot_max = max(ratios) if ratios and len(ratios) == len(below) else None
    itl_max = max(itls) if itls else None
    return {
        "knee_rate": knee["knee_rate"],
        "knee": knee,
        "tpot_over_decode_step_max_below_knee": tpot_max,
        "p99_itl_ms_max_below_knee": itl_max,
        "below_knee_goals": {
            "tpot_over_decode_step_max": TPOT_OVER_DECODE_STEP_GOAL,
            "p99_itl_ms_max": P99_ITL_MS_GOAL,
            "tpot_met": None if tpot_max is None else tpot_max <= TPOT_OVER_DECODE_STEP_GOAL,
            "p99_itl_met": None if itl_max is None else itl_max <= P99_ITL_MS_GOAL,
        },
    }


def saturation_line(per_rate: list[dict[str, Any]], max_growth: float) -> dict[str, Any]:
    rec = saturation_record(per_rate, max_growth)
    return {k: rec[k] for k in ("knee_rate", "tpot_over_decode_step_max_below_knee",
                                "p99_itl_ms_max_below_knee")}


def format_saturation_table(per_rate: list[dict[str, Any]], max_growth: float) -> str:
    """One row per rate: offered and achieved output tok/s, the batch the server ran at, median
    TPOT, P99 ITL, whether the rate follows its load; then the knee and the goals."""
    head = (f"{'rate':>7} {'offered':>9} {'out tok/s':>10} {'batch med/mean/max':>20} "
            f"{'wait max':>8} {'TPOT med':>9} {'ITL p99':>8} {'growth':>7} {'follows':>8} "
            f"{'step ms':>8} {'TPOT/step':>9}")
    lines = ["{s:{c}^{w}}".format(s=" Below saturation ", c="=", w=len(head)), head,
             "-" * len(head)]
    for s in sorted(per_rate, key=lambda x: x["request_rate"]):
        batch = "/".join(fmt(s.get(k), ".0f") for k in
                         ("batch_size_median", "batch_size_mean", "batch_size_max"))
        follows = {True: "yes", False: "no", None: "n/a"}[s.get("follows_offered_load")]
        lines.append(
            f"{rate_label(s['request_rate']):>7} {fmt(s.get('offered_output_tok_s'), '.0f'):>9} "
            f"{s['output_throughput']:>10.1f} {batch:>20} {fmt(s.get('waiting_max'), 'd'):>8} "
            f"{s['median_tpot_ms']:>9.1f} {s['p99_itl_ms']:>8.1f} "
            f"{fmt(s.get('latency_growth'), '.2f'):>7} {follows:>8} "
            f"{fmt(s.get('offline_decode_step_ms'), '.2f'):>8} "
            f"{fmt(s.get('tpot_over_decode_step'), '.2f'):>9}"
        )
    rec = saturation_record(per_rate, max_growth)
    lines.append("-" * len(head))
    lines.append(rec["knee"]["note"] + f" (latency growth bound {max_growth:g})")
    lines.append(
        "up to the knee: median TPOT / offline decode step at most "
        f"{fmt(rec['tpot_over_decode_step_max_below_knee'], '.2f')} (goal <= "
        f"{TPOT_OVER_DECODE_STEP_GOAL:g}), P99 ITL at most "
        f"{fmt(rec['p99_itl_ms_max_below_knee'], '.1f')} ms (goal <= {P99_ITL_MS_GOAL:g})"
    )
    return "\n".join(lines)
