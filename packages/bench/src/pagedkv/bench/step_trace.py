"""Where a served token's time goes: an engine core step trace cut per benchmark rate.

`python -m pagedkv.bench.step_trace TRACE.jsonl --sweep-json SWEEP.json` reads the trace the
engine core writes under `PAGEDKV_STEP_TRACE` (`pagedkv.engine.core.step_trace`) and the
`bench serve --request-rates` result of the same run (each rate's `started_at`/`ended_at`), and
prints per rate: the steps per second, the share of steps that carry a prefill chunk, the
median interval between the ends of consecutive steps for decode-only steps and for steps with
a prefill (a token's TPOT averages these intervals), the median prompt tokens of a prefill
step, and the share of steps scheduled asynchronously. With `--write`, each rate of the sweep
JSON gets these figures under `"steps"`.

Why: issue 21's goal compares the served TPOT with the offline engine's decode step at the same
batch size; the difference is the steps that are not plain decodes (prefills of arriving
requests, the plain loop instead of the asynchronous one) and the host time between steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The trace's steps in the order they ended (a line cut short at the end is dropped)."""
    steps = []
    with open(path) as f:
        for line in f:
            try:
                steps.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    steps.sort(key=lambda s: s["t"])
    return steps


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summarize_window(steps: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """The figures of the steps that ended in [start, end] (see the module docstring). A step's
    interval is the time since the step before it ended (the first step of the window has
    none); a step "with prefill" computed at least one prompt token."""
    decode_iv: list[float] = []
    prefill_iv: list[float] = []
    prefill_tokens: list[int] = []
    n = n_prefill = n_async = 0
    prev_t: float | None = None
    for s in steps:
        t = s["t"]
        if t < start:
            prev_t = t
            continue
        if t > end:
            break
        n += 1
        with_prefill = s["prefill_tokens"] > 0
        n_prefill += with_prefill
        n_async += "wait" in s
        if with_prefill:
            prefill_tokens.append(s["prefill_tokens"])
        if prev_t is not None:
            (prefill_iv if with_prefill else decode_iv).append((t - prev_t) * 1e3)
        prev_t = t
    span = end - start
    return {
        "num_steps": n,
        "steps_per_s": round(n / span, 2) if span > 0 else None,
        "prefill_step_share": round(n_prefill / n, 4) if n else None,
        "async_step_share": round(n_async / n, 4) if n else None,
        "decode_step_interval_ms_median": _median(decode_iv),
        "prefill_step_interval_ms_median": _median(prefill_iv),
        "all_step_interval_ms_mean": (round(statistics.fmean(decode_iv + prefill_iv), 4)
                                      if decode_iv or prefill_iv else None),
        "prefill_tokens_median": _median(prefill_tokens),
    }


def summarize_sweep(steps: list[dict[str, Any]], rates: Iterable[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """`summarize_window` for each rate of a sweep that has `started_at` and `ended_at`."""
    out = []
    for r in rates:
        if r.get("started_at") is None or r.get("ended_at") is None:
            raise ValueError(f"rate {r.get('request_rate')} has no started_at/ended_at: "
                             "run the sweep with a pagedkv-bench that records them")
        out.append({"request_rate": r["request_rate"],
                    **summarize_window(steps, r["started_at"], r["ended_at"])})
    return out


COLUMNS = (
    ("request_rate", "rate", "{:g}"),
    ("steps_per_s", "steps/s", "{:.1f}"),
    ("prefill_step_share", "prefill share", "{:.0%}"),
    ("async_step_share", "async share", "{:.0%}"),
    ("decode_step_interval_ms_median", "decode ms", "{:.2f}"),
    ("prefill_step_interval_ms_median", "prefill ms", "{:.2f}"),
    ("all_step_interval_ms_mean", "mean ms", "{:.2f}"),
    ("prefill_tokens_median", "prefill tok", "{:.0f}"),
)


def table(rows: list[dict[str, Any]]) -> str:
    head = "".join(f"{title:>15}" for _, title, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = row.get(key)
            cells.append(f"{'n/a' if v is None else fmt.format(v):>15}")
        lines.append("".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.bench.step_trace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="the engine core's step trace (PAGEDKV_STEP_TRACE)")
    parser.add_argument("--sweep-json", required=True,
                        help="the `bench serve --request-rates` result of the same run")
    parser.add_argument("--write", action="store_true",
                        help="add each rate's figures to the sweep JSON (key 'steps')")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.sweep_json).read_text())
    try:
        rows = summarize_sweep(read_trace(args.trace), data.get("rates", []))
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    print(table(rows))
    if args.write:
        for rate, row in zip(data["rates"], rows):
            rate["steps"] = {k: v for k, v in row.items() if k != "request_rate"}
        Path(args.sweep_json).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
