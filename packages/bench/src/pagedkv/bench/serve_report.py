"""The figures of a `pagedkv bench serve` run and how they are shown: `summarize` turns the
requests' results into vLLM's figures (TTFT, TPOT, ITL and end-to-end latency: mean, median,
P99, and throughput) and the PagedAttention paper's normalized latency; `sweep_summary` finds a
sweep's sustainable rate; `format_report` and `format_sweep_table` print the tables,
`plot_sweep` draws the paper's curve, and `json_ready` and `write_json` keep the figures as JSON
(the last line printed, the `--result-json` file).

Functions of the results alone (no server, no clock), so that every figure is tested on results
made by hand.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from pagedkv.bench.serve_requests import RequestResult

#: Default bound on normalized latency for `--request-rates`, in seconds per output token.
#: 0.2 s/token is 5 tokens/s per user over the whole request, queueing and prefill included:
#: about the pace at which people read (200-300 words a minute, at ~1.3 tokens a word, is
#: 4.5-6.5 tokens/s). Slower than that, a streamed answer makes its reader wait. It is also
#: the region where the paper's curves turn upward: below saturation a GPU serving an 8B model
#: stays near its decode time per token (tens of ms); past saturation queueing makes the
#: normalized latency grow without bound, so the sustainable rate barely moves with the exact
#: bound chosen.
DEFAULT_LATENCY_BOUND = 0.2

#: Per-rate figures of the sweep's last JSON line (the --result-json file has every figure).
SWEEP_KEYS = (
    "request_rate",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
    "normalized_latency_s_per_token",
    "completed",
    "failed",
    "duration_s",
)


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile, interpolated between the two nearest ranks (numpy's default);
    0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float, model: str) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1) * 1000
        for r in ok
        if r.output_tokens > 1 and r.streamed
    ]
    itls = [x * 1000 for r in ok for x in r.itl]
    e2es = [r.e2e * 1000 for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    # The PagedAttention paper's normalized latency: each request's end-to-end latency over
    # its output length, averaged over requests (s/token). None when nothing completed.
    per_token = [r.e2e / r.output_tokens for r in ok if r.output_tokens > 0]
    summary: dict[str, Any] = {
        "model": model,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "normalized_latency_s_per_token": statistics.fmean(per_token) if per_token else None,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        summary[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        summary[f"median_{name}_ms"] = statistics.median(values) if values else 0.0
        summary[f"p99_{name}_ms"] = percentile(values, 99)
    return summary


def sweep_summary(per_rate: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    """The sustainable rate of a sweep under a normalized-latency bound (s/token).

    A rate is *within the bound* when every request completed and the normalized latency is at
    most `bound` (a server that fails requests does not sustain that rate). The sustainable rate
    is the highest rate such that it and every lower rate tested are within the bound: a noisy
    point above the first crossing does not count (it is reported as
    `highest_rate_within_bound`). `status` says where the bound fell:
    "crossed" (between two tested rates), "lowest_rate_exceeds_bound" (no rate sustainable: test
    lower rates) or "all_rates_within_bound" (the sustainable rate is at least the highest
    tested: test higher rates).
    """
    if not per_rate:
        raise ValueError("a sweep summary needs at least one rate's results")
    if not bound > 0:
        raise ValueError(f"the latency bound must be > 0 s/token (got {bound})")
    ordered = sorted(per_rate, key=lambda s: s["request_rate"])

    def within(s: dict[str, Any]) -> bool:
        norm = s.get("normalized_latency_s_per_token")
        return s["completed"] > 0 and s["failed"] == 0 and norm is not None and norm <= bound

    flags = [within(s) for s in ordered]
    rates = [float(s["request_rate"]) for s in ordered]
    sustainable: float | None = None
    first_over: float | None = None
    for rate, ok in zip(rates, flags):
        if not ok:
            first_over = rate
            break
        sustainable = rate
    if sustainable is None:
        status = "lowest_rate_exceeds_bound"
        note = (
            f"even the lowest rate, {rate_label(rates[0])} req/s, exceeds {bound:g} s/token "
            "(or fails requests): no tested rate is sustainable; test lower rates"
        )
    elif first_over is None:
        status = "all_rates_within_bound"
        note = (
            f"every rate up to the highest tested, {rate_label(rates[-1])} req/s, stays within "
            f"{bound:g} s/token: the sustainable rate is at least that; test higher rates"
        )
    else:
        status = "crossed"
        note = (
            f"sustainable rate {rate_label(sustainable)} req/s: normalized latency within "
            f"{bound:g} s/token up to it, over the bound (or failing requests) at "
            f"{rate_label(first_over)} req/s"
        )
    within_rates = [r for r, ok in zip(rates, flags) if ok]
    highest = max(within_rates) if within_rates else None
    if highest is not None and (sustainable is None or highest > sustainable):
        note += f"; {rate_label(highest)} req/s is within the bound again (a noisy curve)"
    return {
        "latency_bound_s_per_token": bound,
        "sustainable_rate": sustainable,
        "status": status,
        "first_rate_over_bound": first_over,
        "highest_rate_within_bound": highest,
        "note": note,
    }


def rate_label(r: float) -> str:
    """A request rate as the tables print it (`inf` for everything at once)."""
    return f"{r:g}"


def fmt(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_report(s: dict[str, Any]) -> str:
    rate = s.get("request_rate")
    title = " Serving Benchmark Result "
    if rate is not None:
        title = f" Serving Benchmark Result @ {rate_label(rate)} req/s "
    lines = ["{s:{c}^50}".format(s=title, c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:<10}")

    row("Successful requests:", s["completed"])
    row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    for key, title, label in (
        ("ttft", "Time to First Token", "TTFT"),
        ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl", "Inter-token Latency", "ITL"),
        ("e2el", "End-to-end Latency", "E2EL"),
    ):
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        row(f"Mean {label} (ms):", s[f"mean_{key}_ms"])
        row(f"Median {label} (ms):", s[f"median_{key}_ms"])
        row(f"P99 {label} (ms):", s[f"p99_{key}_ms"])
    lines.append("{s:{c}^50}".format(s=" Normalized latency (E2EL / output tokens) ", c="-"))
    row("Mean normalized latency (s/token):", fmt(s.get("normalized_latency_s_per_token"), ".4f"))
    lines.append("=" * 50)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def format_sweep_table(per_rate: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """One row per rate: the curve at a glance, then the sustainable rate."""
    head = (
        f"{'rate':>7} {'req/s':>7} {'out tok/s':>10} "
        f"{'TTFT ms mean/med/p99':>24} {'TPOT ms mean/med/p99':>24} "
        f"{'E2E s mean/med/p99':>22} {'norm s/tok':>10} {'ok':>5} {'fail':>4}"
    )
    lines = ["{s:{c}^120}".format(s=" Request-rate sweep ", c="="), head, "-" * len(head)]

    def three(s: dict[str, Any], key: str, scale: float, spec: str) -> str:
        return "/".join(format(s[f"{k}_{key}_ms"] * scale, spec) for k in ("mean", "median", "p99"))

    for s in sorted(per_rate, key=lambda x: x["request_rate"]):
        lines.append(
            f"{rate_label(s['request_rate']):>7} {s['request_throughput']:>7.2f} "
            f"{s['output_throughput']:>10.1f} {three(s, 'ttft', 1, '.0f'):>24} "
            f"{three(s, 'tpot', 1, '.1f'):>24} {three(s, 'e2el', 1e-3, '.2f'):>22} "
            f"{fmt(s['normalized_latency_s_per_token'], '.4f'):>10} "
            f"{s['completed']:>5} {s['failed']:>4}"
        )
    lines.append("-" * len(head))
    lines.append(
        f"latency bound {summary['latency_bound_s_per_token']:g} s/token: {summary['note']}"
    )
    return "\n".join(lines)


def plot_sweep(
    per_rate: list[dict[str, Any]], summary: dict[str, Any], path: str | Path, title: str
) -> str | None:
    """Normalized latency against request rate, the bound as a horizontal line; None when
    written, else why not (matplotlib missing). matplotlib is imported here only, so the
    benchmark runs without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written (pip install matplotlib)"
    points = sorted(
        (float(s["request_rate"]), float(s["normalized_latency_s_per_token"]))
        for s in per_rate
        if s.get("normalized_latency_s_per_token") is not None
    )
    bound = float(summary["latency_bound_s_per_token"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    try:
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label="measured")
        ax.axhline(bound, color="tab:red", linestyle="--", label=f"bound {bound:g} s/token")
        if summary.get("sustainable_rate") is not None:
            ax.axvline(
                summary["sustainable_rate"],
                color="gray",
                linestyle=":",
                label=f"sustainable {rate_label(summary['sustainable_rate'])} req/s",
            )
        # Past saturation the latency grows without bound; like the paper's figures, the axis
        # stops at a few times the bound so that the flat part stays readable.
        top = max((p[1] for p in points), default=bound)
        ax.set_ylim(0, min(max(top * 1.1, bound * 2), bound * 5))
        ax.set_xlim(left=0)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return None


def json_ready(value: Any) -> Any:
    """Floats rounded for reading, inf as the string "inf" (JSON has no infinity)."""
    if isinstance(value, float):
        return "inf" if math.isinf(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return value


def write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(json_ready(data), indent=2) + "\n", encoding="utf-8")
