"""`pagedkv bench serve` (or `python -m pagedkv.bench.serve`): load generator for any
OpenAI-compatible completions server.

Sends `--num-prompts` streaming requests to `/v1/completions`, arriving as a Poisson process at
`--request-rate` requests per second (or all at once with `inf`), at most `--max-concurrency`
in flight, and reports what a user of the server feels: time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL, the gaps between streamed
chunks) and end-to-end latency, plus request and token throughput. The printout follows vLLM's
`benchmark_serving.py` so the figures compare line by line; the last line is one JSON object.

Prompts are random token ids (exact input lengths on any server that accepts token-id prompts,
as OpenAI's API does); lengths are fixed (`--input-len`, `--output-len`) or drawn from a named
workload of `pagedkv.bench.workloads` (ShareGPT-like conversations, Alpaca-like
instructions) or a file of real lengths.
Generation runs with `ignore_eos` so each request produces exactly its output length
(`--no-ignore-eos` for servers that reject the field).

Tokens are counted from the stream: a chunk that carries `token_ids` (vLLM's `return_token_ids`,
and every chunk of a server without a tokenizer, whose text is empty) counts as that many
tokens, a chunk with only text as one; the final usage, when the server sends it, is exact.

`--request-rates 1,2,4,...` sweeps the request rate, as the PagedAttention paper's figures do:
the same seeded requests (and the same arrival pattern, scaled) at each rate, one table each, then
the paper's *normalized latency* (the mean over requests of end-to-end latency divided by output
tokens, in s/token) against the rate, and the *sustainable rate*: the highest rate whose
normalized latency stays within `--latency-bound` (default 0.2 s/token, see `DEFAULT_LATENCY_BOUND`).

`--no-stream` sends non-streaming requests (TTFT is then the whole latency, and there is no
ITL or TPOT).

`--compare-offline --engine-args "..."` measures the serving path against the engine itself on
the same requests and engine options, in one call (`pagedkv.bench.serve_compare` says how).

This module is the command: its options and their checks, the printout and the JSON. The rest
is one idea a module: `serve_requests` (what is sent: the seeded requests, `--dataset
sharegpt`), `serve_client` (sending them and timing the stream: one run, a sweep's rates),
`serve_report` (the figures, the tables and the sweep's plot), `serve_saturation` (below
saturation: the batch the server ran at, the knee) and `serve_compare` (`--compare-offline`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import platform
import sys
import time
from typing import Any

import httpx

from pagedkv.bench.env import environment
from pagedkv.bench.serve_client import run_benchmark, run_sweep, single_rate
from pagedkv.bench.serve_compare import format_compare, run_compare_offline, split_engine_args
from pagedkv.bench.serve_report import (
    DEFAULT_LATENCY_BOUND,
    SWEEP_KEYS,
    format_report,
    format_sweep_table,
    json_ready,
    plot_sweep,
    rate_label,
    sweep_summary,
    write_json,
)
from pagedkv.bench.serve_requests import add_dataset_arg, check_dataset
from pagedkv.bench.serve_saturation import (
    SATURATION_KEYS,
    add_saturation_args,
    check_saturation,
    format_saturation_table,
    saturation_line,
    saturation_record,
)


def parse_rates(text: str) -> list[float]:
    """`1,2,4.5` -> [1.0, 2.0, 4.5], ascending, each once; a clear error otherwise."""
    rates: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(
                f"--request-rates: {part!r} is not a number (give e.g. 1,2,4,8)"
            ) from None
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(
                f"--request-rates: {part!r} must be a finite rate > 0 "
                "(for all requests at once use --request-rate inf)"
            )
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rates: give at least one rate, e.g. 1,2,4,8")
    return sorted(set(rates))


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, without /v1 (default http://127.0.0.1:8000)",
    )
    parser.add_argument("--endpoint", default="/v1/completions", help="completions path")
    parser.add_argument(
        "--model", default=None, help="model name (default: the first of /v1/models)"
    )
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--workload",
        default="random",
        help="random (default): fixed --input-len/--output-len; sharegpt or alpaca: lengths "
        "drawn like those datasets' (pagedkv.bench.workloads); or a .json/.jsonl file of "
        "real (input, output) lengths",
    )
    parser.add_argument(
        "--input-len", type=int, default=128, help="prompt tokens (random workload)"
    )
    parser.add_argument(
        "--output-len", type=int, default=128, help="generated tokens (random workload)"
    )
    parser.add_argument(
        "--max-total-len",
        type=int,
        default=2048,
        help="drawn lengths with input + output above this are drawn again (default 2048)",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=100, help="requests to send (at each rate of a sweep)"
    )
    add_dataset_arg(parser)
    add_saturation_args(parser)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests per second, Poisson arrivals; inf sends all at once (default)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="random prompt token ids are drawn below this (default: the served model's "
        "vocabulary size, from /v1/models)",
    )
    parser.add_argument(
        "--min-token-id",
        type=int,
        default=100,
        help="and at or above this, to avoid special tokens (default 100)",
    )
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (outputs may then end early)",
    )
    parser.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="non-streaming requests (TTFT is the whole latency; no TPOT or ITL)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--result-json",
        default=None,
        metavar="PATH",
        help="also write the setup and every figure (each rate's, and the sweep's summary) "
        "to this JSON file",
    )
    g = parser.add_argument_group(
        "request-rate sweep",
        "normalized latency (mean of end-to-end latency / output tokens) against request "
        "rate, as in the PagedAttention paper's figures",
    )
    g.add_argument(
        "--request-rates",
        type=parse_rates,
        default=None,
        metavar="R1,R2,...",
        help="sweep: the same seeded requests at each of these rates (req/s, Poisson "
        "arrivals), ascending; replaces --request-rate",
    )
    g.add_argument(
        "--latency-bound",
        type=float,
        default=DEFAULT_LATENCY_BOUND,
        metavar="S",
        help="normalized latency (s/token) a rate must stay within to count as sustainable "
        f"(default {DEFAULT_LATENCY_BOUND}: 5 tokens/s per user, about reading speed)",
    )
    g.add_argument(
        "--pause-between-rates",
        type=float,
        default=0.0,
        metavar="S",
        help="seconds to wait between rates, letting the server settle (default 0)",
    )
    g.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        metavar="N",
        help="before the sweep, send the first N requests at once, cut to 16 output tokens, "
        "and do not count them (kernel compilation and first allocations; default 0)",
    )
    g.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="draw normalized latency against request rate, the bound as a line (matplotlib)",
    )
    c = parser.add_argument_group(
        "server vs offline engine",
        "start the server here and compare it with the offline engine on the same requests",
    )
    c.add_argument(
        "--compare-offline",
        action="store_true",
        help="run the offline engine and the server (streaming, then non-streaming, all "
        "requests at once) with --engine-args, --repeats times, interleaved",
    )
    c.add_argument(
        "--engine-args",
        default="",
        metavar="'OPTIONS'",
        help="engine options for both, as pagedkv serve takes them (quoted), e.g. "
        "\"--model meta-llama/Meta-Llama-3-8B --load-format dummy --max-num-seqs 1024\"",
    )
    c.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    c.add_argument(
        "--server-start-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds the server may take to become healthy (default 600)",
    )
    c.add_argument(
        "--offline-timeout",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds an offline run may take (default 1800)",
    )


def _check(args: argparse.Namespace) -> None:
    check_dataset(args)
    check_saturation(args)
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.vocab_size is not None and not 0 <= args.min_token_id < args.vocab_size:
        raise ValueError("need 0 <= --min-token-id < --vocab-size")
    if args.max_total_len < 2:
        raise ValueError("--max-total-len must be >= 2")
    if args.request_rates is not None and args.request_rate is not None:
        raise ValueError("give --request-rate (one run) or --request-rates (a sweep), not both")
    if args.request_rates is None and args.plot:
        raise ValueError("--plot draws a sweep: give --request-rates too")
    if not (args.latency_bound > 0 and math.isfinite(args.latency_bound)):
        raise ValueError("--latency-bound must be a finite number of seconds per token > 0")
    if not (args.pause_between_rates >= 0 and math.isfinite(args.pause_between_rates)):
        raise ValueError("--pause-between-rates must be >= 0 seconds")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must be >= 0")
    if args.compare_offline:
        if args.request_rates is not None or args.request_rate is not None:
            raise ValueError("--compare-offline sends every request at once: drop "
                             "--request-rate / --request-rates")
        if args.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        split_engine_args(args.engine_args)  # a clear error before anything starts
    elif args.engine_args:
        raise ValueError("--engine-args goes with --compare-offline")
    if args.workload != "random":
        from pagedkv.bench.workloads import sample_lengths

        sample_lengths(args.workload, 0, max_total=args.max_total_len)  # a clear error for a typo


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv.bench.__about__ import __version__

    options = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    env = environment()
    return {
        "benchmark": "pagedkv bench serve",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "client": f"Python {env['python']} on {env['machine']}, "
        f"httpx {httpx.__version__}, pagedkv-bench {__version__}",
        "command": env["command"],
        "options": json_ready(options),
        "env": env,
    }


def _print_header(args: argparse.Namespace) -> None:
    if args.request_rates is not None:
        rate = ", ".join(rate_label(r) for r in args.request_rates) + " req/s (Poisson), a sweep"
    else:
        r = single_rate(args)
        rate = "inf" if r == math.inf else f"{r:g} req/s (Poisson)"
    lengths = (
        f"input {args.input_len}, output {args.output_len} tokens"
        if args.workload == "random"
        else f"lengths drawn from {args.workload} (input + output <= {args.max_total_len})"
    )
    print(f"pagedkv bench serve: {args.base_url}{args.endpoint}")
    print(f"  workload: {args.workload}, {lengths}; {args.num_prompts} prompts, seed {args.seed}")
    print(f"  request rate: {rate}; max concurrency: {args.max_concurrency or 'unlimited'}")
    print(
        f"  client: Python {platform.python_version()} on {platform.machine()}, httpx {httpx.__version__}"
    )


def _run_sweep_cli(args: argparse.Namespace) -> int:
    print(
        f"  latency bound: {args.latency_bound:g} s/token; "
        f"pause between rates: {args.pause_between_rates:g} s; "
        f"warm-up requests: {args.warmup_requests}",
        flush=True,
    )
    setup = _setup(args)
    done: list[dict[str, Any]] = []

    def save(per_rate: list[dict[str, Any]], summary: dict[str, Any], partial: bool) -> str | None:
        """Write the JSON and the plot; why the plot was not drawn, or None."""
        model = per_rate[0]["model"]
        if args.result_json:
            record = {"setup": setup, "model": model, "partial": partial,
                      **saturation_record(per_rate, args.knee_latency_growth)}
            write_json(args.result_json, {**record, "summary": summary, "rates": per_rate})
        if not args.plot:
            return None
        title = f"{model}, {args.workload}, {args.num_prompts} requests per rate"
        return plot_sweep(per_rate, summary, args.plot, title)

    def show(summary: dict[str, Any]) -> None:
        print(format_report(summary), flush=True)
        done.append(summary)
        if len(done) < len(args.request_rates):
            # a long sweep that is cut short keeps the rates it finished
            save(done, sweep_summary(done, args.latency_bound), partial=True)

    sweep = asyncio.run(run_sweep(args, on_rate=show))
    per_rate = sweep["rates"]
    summary = sweep_summary(per_rate, args.latency_bound)
    print(f"  model: {sweep['model']}")
    if sweep["warmup_failed"]:
        print(f"  warning: {sweep['warmup_failed']} warm-up request(s) failed")
    print(format_sweep_table(per_rate, summary))
    print(format_saturation_table(per_rate, args.knee_latency_growth))
    why_not = save(per_rate, summary, partial=False)
    if args.plot:
        print(f"  plot: {args.plot}" if why_not is None else f"  plot: {why_not}")
    if args.result_json:
        print(f"  results: {args.result_json}")
    line = {
        "model": sweep["model"],
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        **{k: v for k, v in summary.items() if k != "note"},
        **saturation_line(per_rate, args.knee_latency_growth),
        "rates": [{**{k: s[k] for k in SWEEP_KEYS}, **{k: s.get(k) for k in SATURATION_KEYS}}
                  for s in per_rate],
    }
    print(json.dumps(json_ready(line)))
    return 0 if any(s["completed"] > 0 for s in per_rate) else 1


def _run_compare_cli(args: argparse.Namespace) -> int:
    print(f"  compare with the offline engine: engine options {args.engine_args!r}, "
          f"{args.repeats} repeats, warm-up requests: {args.warmup_requests}", flush=True)
    setup = _setup(args)

    def save(result: dict[str, Any]) -> None:
        if args.result_json:
            write_json(args.result_json, {"setup": setup, **result})

    result = run_compare_offline(args, on_repeat=save)
    print(format_compare(result))
    if args.result_json:
        print(f"  results: {args.result_json}")
    print(json.dumps(json_ready({k: v for k, v in result.items() if k not in ("env",
                                                                                 "offline_env")})))
    return 0 if result["failed"] == 0 else 1


def run_bench_serve(args: argparse.Namespace) -> int:
    _check(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one log line per request otherwise
    _print_header(args)
    if args.compare_offline:
        return _run_compare_cli(args)
    if args.request_rates is not None:
        return _run_sweep_cli(args)
    summary = asyncio.run(run_benchmark(args))
    print(f"  model: {summary['model']}")
    print(format_report(summary))
    if args.result_json:
        rate = single_rate(args)
        write_json(
            args.result_json,
            {
                "setup": _setup(args),
                "model": summary["model"],
                "rates": [{"request_rate": rate, **summary}],
            },
        )
        print(f"  results: {args.result_json}")
    keys = (
        "request_throughput",
        "output_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "median_e2el_ms",
        "p99_e2el_ms",
        "normalized_latency_s_per_token",
        "completed",
        "failed",
        "duration_s",
    )
    line = {
        k: (
            round(summary[k], 3 if k.endswith("_ms") else 4)
            if isinstance(summary[k], float)
            else summary[k]
        )
        for k in keys
    }
    print(json.dumps(line))
    return 0 if summary["completed"] > 0 else 1


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve` under `pagedkv bench` (entry point group `pagedkv.bench_subcommands`)."""
    parser = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
        description=__doc__.split("\n\n")[0],
    )
    add_bench_serve_args(parser)
    parser.set_defaults(func=run_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.bench.serve", description=__doc__.split("\n\n")[0]
    )
    add_bench_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_bench_serve(args)
    except ValueError as exc:
        print(f"pagedkv bench serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
