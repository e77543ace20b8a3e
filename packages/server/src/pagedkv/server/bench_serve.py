"""`pagedkv bench serve`: load generator for any OpenAI-compatible completions server.

Sends `--num-prompts` streaming requests to `/v1/completions`, arriving as a Poisson process at
`--request-rate` requests per second (or all at once with `inf`), at most `--max-concurrency`
in flight, and reports what a user of the server feels: time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL, the gaps between streamed
chunks) and end-to-end latency, plus request and token throughput. The printout follows vLLM's
`benchmark_serving.py` so the figures compare line by line; the last line is one JSON object.

Prompts are random token ids (exact input lengths on any server that accepts token-id prompts,
as OpenAI's API does); lengths are fixed (`--input-len`, `--output-len`) or drawn from a named
workload of `pagedkv.scheduler.workloads` (ShareGPT-like conversations, Alpaca-like
instructions) or a file of real lengths.
Generation runs with `ignore_eos` so each request produces exactly its output length
(`--no-ignore-eos` for servers that reject the field).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(slots=True)
class RequestSpec:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_requests(args: argparse.Namespace) -> list[RequestSpec]:
    """The request list; the same `--seed` gives the same prompts and lengths."""
    rng = random.Random(args.seed)
    if args.workload == "random":
        lengths = [(args.input_len, args.output_len)] * args.num_prompts
    else:
        # The scheduler's named workloads (the simulator and the offline bench use the same).
        from pagedkv.scheduler.workloads import sample_lengths

        lengths = sample_lengths(
            args.workload, args.num_prompts, seed=args.seed, max_total=args.max_total_len
        )
    specs = []
    for in_len, out_len in lengths:
        prompt = [rng.randrange(args.min_token_id, args.vocab_size) for _ in range(in_len)]
        specs.append(RequestSpec(prompt, out_len))
    return specs


async def _one_request(
    client: httpx.AsyncClient, url: str, args: argparse.Namespace, model: str, spec: RequestSpec
) -> RequestResult:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        payload["ignore_eos"] = True
    result = RequestResult(prompt_len=len(spec.prompt))
    start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens: int | None = None
    done = False
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))
                    return result
                if event.get("usage"):
                    usage_tokens = int(event["usage"].get("completion_tokens", 0))
                choices = event.get("choices") or []
                if any(c.get("text") for c in choices):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if not done:
        result.error = "stream ended without [DONE]"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def _arrivals(rate: float, n: int, rng: random.Random):
    for i in range(n):
        yield i
        if rate != math.inf and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = args.model
        if model is None:
            resp = await client.get(base + "/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        specs = make_requests(args)
        url = base + args.endpoint
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed + 1)

        async def limited(spec: RequestSpec) -> RequestResult:
            if sem is None:
                return await _one_request(client, url, args, model, spec)
            async with sem:
                return await _one_request(client, url, args, model, spec)

        tasks = []
        start = time.perf_counter()
        async for i in _arrivals(args.request_rate, len(specs), rng):
            tasks.append(asyncio.ensure_future(limited(specs[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, model)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float, model: str) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itls = [x * 1000 for r in ok for x in r.itl]
    e2es = [r.e2e * 1000 for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
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
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        summary[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        summary[f"median_{name}_ms"] = statistics.median(values) if values else 0.0
        summary[f"p99_{name}_ms"] = _pct(values, 99)
    return summary


def format_report(s: dict[str, Any]) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

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
    lines.append("=" * 50)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


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
        "drawn like those datasets' (pagedkv.scheduler.workloads); or a .json/.jsonl file of "
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
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
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
        default=32000,
        help="random prompt token ids are drawn below this (default 32000)",
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
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def _check(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not 0 <= args.min_token_id < args.vocab_size:
        raise ValueError("need 0 <= --min-token-id < --vocab-size")
    if args.max_total_len < 2:
        raise ValueError("--max-total-len must be >= 2")
    if args.workload != "random":
        from pagedkv.scheduler.workloads import sample_lengths

        sample_lengths(args.workload, 0, max_total=args.max_total_len)  # a clear error for a typo


def run_bench_serve(args: argparse.Namespace) -> int:
    _check(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one log line per request otherwise
    rate = "inf" if args.request_rate == math.inf else f"{args.request_rate:g} req/s (Poisson)"
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
    summary = asyncio.run(run_benchmark(args))
    print(f"  model: {summary['model']}")
    print(format_report(summary))
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
        "completed",
        "failed",
        "duration_s",
    )
    line = {
        k: (round(summary[k], 3) if isinstance(summary[k], float) else summary[k]) for k in keys
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
        prog="python -m pagedkv.server.bench_serve", description=__doc__.split("\n\n")[0]
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
