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
the same requests and engine options, in one call: each repeat runs the offline engine
(`python -m pagedkv.bench.throughput --dataset` on these requests), then starts the server
(`python -m pagedkv.server`) with the same options, sends every request at once streaming and
then non-streaming, and stops it (the order alternates between repeats). It reports the median
output tok/s of each and their ratio, the spread over repeats, TPOT and ITL percentiles, where
the time to first token went (the server's queue and prefill histograms), and the CPU share the
API process and the engine core used (whether more API processes could help).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagedkv.bench.env import environment, hardware

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
    streamed: bool = True  # False: a non-streaming request (no TPOT, no ITL)


def make_requests(args: argparse.Namespace) -> list[RequestSpec]:
    """The request list; the same `--seed` gives the same prompts and lengths.
    `args.vocab_size` must be known (given, or read from the server by `_model_name`)."""
    if args.vocab_size is None:
        raise ValueError("the vocabulary size is not known yet: give --vocab-size")
    if getattr(args, "dataset", None) == "sharegpt":  # issue 19: the real dataset
        return _sharegpt_requests(args)
    rng = random.Random(args.seed)
    if args.workload == "random":
        lengths = [(args.input_len, args.output_len)] * args.num_prompts
    else:
        # The named workloads (the simulator and the offline bench use the same).
        from pagedkv.bench.workloads import sample_lengths

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
    if not getattr(args, "stream", True):
        return await _one_plain_request(client, url, payload, spec)
    result = RequestResult(prompt_len=len(spec.prompt))
    start = time.perf_counter()
    last = start
    chunks = 0
    streamed_tokens = 0
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
                # token_ids: a server without a tokenizer streams empty text and the ids
                n_ids = sum(len(c.get("token_ids") or ()) for c in choices)
                if n_ids or any(c.get("text") for c in choices):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                    streamed_tokens += n_ids or 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if not done:
        result.error = "stream ended without [DONE]"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else streamed_tokens
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def _one_plain_request(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], spec: RequestSpec
) -> RequestResult:
    """A non-streaming request: its latency is its TTFT and E2EL; tokens from `usage`."""
    payload = {**payload, "stream": False}
    del payload["stream_options"]
    result = RequestResult(prompt_len=len(spec.prompt), streamed=False)
    start = time.perf_counter()
    try:
        resp = await client.post(url, json=payload)
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return result
        body = resp.json()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = result.ttft = time.perf_counter() - start
    usage = body.get("usage") or {}
    result.output_tokens = int(usage.get("completion_tokens", 0))
    result.ok = result.output_tokens > 0
    if not result.ok:
        result.error = "no tokens generated"
    return result


async def _arrivals(rate: float, n: int, rng: random.Random):
    for i in range(n):
        yield i
        if rate != math.inf and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


def _client(args: argparse.Namespace) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    return httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits)


async def _model_name(client: httpx.AsyncClient, base: str, args: argparse.Namespace) -> str:
    """The model to ask for; also sets `args.vocab_size` from the served model when it was
    not given (random prompts must stay inside the model's vocabulary)."""
    if args.model is not None and args.vocab_size is not None:
        return str(args.model)
    resp = await client.get(base + "/v1/models")
    resp.raise_for_status()
    cards = resp.json()["data"]
    card = next((c for c in cards if c["id"] == args.model), cards[0])
    if args.vocab_size is None:
        vocab = card.get("vocab_size")
        if not isinstance(vocab, int):
            info = await client.get(base + "/tokenizer_info")
            vocab = info.json().get("vocab_size") if info.status_code == 200 else None
        if not isinstance(vocab, int):
            raise ValueError(
                "the server does not say its vocabulary size (/v1/models, /tokenizer_info): "
                "give --vocab-size"
            )
        args.vocab_size = vocab
        _check_vocab(args)
    return str(args.model) if args.model is not None else str(card["id"])


def _check_vocab(args: argparse.Namespace) -> None:
    if not 0 <= args.min_token_id < args.vocab_size:
        raise ValueError(
            f"need 0 <= --min-token-id < the vocabulary size ({args.vocab_size})"
        )


async def _send_all(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    model: str,
    specs: list[RequestSpec],
    rate: float,
) -> tuple[list[RequestResult], float]:
    """Send `specs` arriving as a Poisson process at `rate`; (results, wall time).

    The arrival gaps come from a generator seeded with `--seed` alone, so every rate of a sweep
    sees the same pattern of gaps, only scaled by 1/rate (`expovariate` divides one draw by the
    rate): the curves differ by the rate, not by the luck of the draw.
    """
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = random.Random(args.seed + 1)

    async def limited(spec: RequestSpec) -> RequestResult:
        if sem is None:
            return await _one_request(client, url, args, model, spec)
        async with sem:
            return await _one_request(client, url, args, model, spec)

    tasks = []
    start = time.perf_counter()
    async for i in _arrivals(rate, len(specs), rng):
        tasks.append(asyncio.ensure_future(limited(specs[i])))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def _single_rate(args: argparse.Namespace) -> float:
    return math.inf if args.request_rate is None else float(args.request_rate)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """One run at `--request-rate`; the summary of `summarize`."""
    base = args.base_url.rstrip("/")
    async with _client(args) as client:
        model = await _model_name(client, base, args)
        specs = make_requests(args)
        results, duration = await _send_all(
            client, base + args.endpoint, args, model, specs, _single_rate(args)
        )
    return summarize(results, duration, model)


async def _warm_up(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    model: str,
    specs: list[RequestSpec],
) -> list[RequestResult]:
    """A few short requests all at once before measuring (kernel compilation, first
    allocations); their prompts are the first requests', outputs cut to 16 tokens."""
    warm = [RequestSpec(s.prompt, min(s.output_len, 16)) for s in specs[: args.warmup_requests]]
    return list(await asyncio.gather(*(_one_request(client, url, args, model, s) for s in warm)))


async def run_sweep(
    args: argparse.Namespace,
    on_rate: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The same requests at each of `--request-rates` (ascending); `on_rate(summary)` after
    each. Returns {"model", "warmup_failed", "rates": [summary + request_rate, ...]}."""
    base = args.base_url.rstrip("/")
    url = base + args.endpoint
    per_rate: list[dict[str, Any]] = []
    warmup_failed = 0
    async with _client(args) as client:
        model = await _model_name(client, base, args)
        specs = make_requests(args)
        if args.warmup_requests:
            warm = await _warm_up(client, url, args, model, specs)
            warmup_failed = sum(not r.ok for r in warm)
        for k, rate in enumerate(args.request_rates):
            if k and args.pause_between_rates > 0:
                await asyncio.sleep(args.pause_between_rates)
            summary = await _measure_rate(client, base, args, model, specs, rate)
            per_rate.append(summary)
            if on_rate is not None:
                on_rate(summary)
    return {"model": model, "warmup_failed": warmup_failed, "rates": per_rate}


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
        summary[f"p99_{name}_ms"] = _pct(values, 99)
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
            f"even the lowest rate, {_rate(rates[0])} req/s, exceeds {bound:g} s/token "
            "(or fails requests): no tested rate is sustainable; test lower rates"
        )
    elif first_over is None:
        status = "all_rates_within_bound"
        note = (
            f"every rate up to the highest tested, {_rate(rates[-1])} req/s, stays within "
            f"{bound:g} s/token: the sustainable rate is at least that; test higher rates"
        )
    else:
        status = "crossed"
        note = (
            f"sustainable rate {_rate(sustainable)} req/s: normalized latency within "
            f"{bound:g} s/token up to it, over the bound (or failing requests) at "
            f"{_rate(first_over)} req/s"
        )
    within_rates = [r for r, ok in zip(rates, flags) if ok]
    highest = max(within_rates) if within_rates else None
    if highest is not None and (sustainable is None or highest > sustainable):
        note += f"; {_rate(highest)} req/s is within the bound again (a noisy curve)"
    return {
        "latency_bound_s_per_token": bound,
        "sustainable_rate": sustainable,
        "status": status,
        "first_rate_over_bound": first_over,
        "highest_rate_within_bound": highest,
        "note": note,
    }


def _rate(r: float) -> str:
    return f"{r:g}"


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_report(s: dict[str, Any]) -> str:
    rate = s.get("request_rate")
    title = " Serving Benchmark Result "
    if rate is not None:
        title = f" Serving Benchmark Result @ {_rate(rate)} req/s "
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
    row("Mean normalized latency (s/token):", _fmt(s.get("normalized_latency_s_per_token"), ".4f"))
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
            f"{_rate(s['request_rate']):>7} {s['request_throughput']:>7.2f} "
            f"{s['output_throughput']:>10.1f} {three(s, 'ttft', 1, '.0f'):>24} "
            f"{three(s, 'tpot', 1, '.1f'):>24} {three(s, 'e2el', 1e-3, '.2f'):>22} "
            f"{_fmt(s['normalized_latency_s_per_token'], '.4f'):>10} "
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
                label=f"sustainable {_rate(summary['sustainable_rate'])} req/s",
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


# ---- --compare-offline: the server against the engine itself, same requests, same options ---

#: Server-side histograms read from /metrics around each run (sum and count of each).
_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def split_engine_args(text: str) -> tuple[str | None, list[str]]:
    """`--engine-args`: (the model, the other engine options), checked with the engine's own
    parser; a clear `ValueError` for anything it does not take."""
    from pagedkv.engine.arg_utils import EngineArgs

    tokens = shlex.split(text)
    parser = argparse.ArgumentParser(prog="--engine-args", add_help=False, exit_on_error=False)
    EngineArgs.add_cli_args(parser)
    try:
        ns, unknown = parser.parse_known_args(tokens)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"--engine-args {text!r}: {exc}") from None
    if unknown:
        raise ValueError(
            f"--engine-args: {' '.join(unknown)} is not an engine option "
            "(see pagedkv serve --help, 'engine options')"
        )
    EngineArgs.from_cli_args(ns)  # every value checked here, before anything starts
    rest: list[str] = []
    skip = False
    for i, tok in enumerate(tokens):
        if skip:
            skip = False
            continue
        if tok == "--model":
            skip = i + 1 < len(tokens)
            continue
        if tok.startswith("--model="):
            continue
        rest.append(tok)
    return ns.model, rest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _scrape(url: str) -> dict[str, float]:
    """The _sum and _count of each of `_HISTOGRAMS` on the server's /metrics."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{")[0]
        for key, metric in _HISTOGRAMS.items():
            for part in ("sum", "count"):
                if name == f"{metric}_{part}":
                    out[f"{key}_{part}"] = out.get(f"{key}_{part}", 0.0) + float(value)
    return out


class _Server:
    """`python -m pagedkv.server` with the engine options, on a free port, logging to a file."""

    def __init__(self, model: str | None, rest: list[str], log_path: Path,
                 start_timeout: float) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "pagedkv.server", *([model] if model else []), *rest,
            "--host", "127.0.0.1", "--port", str(self.port), "--uvicorn-log-level", "warning",
        ]
        self._log = open(log_path, "w")  # noqa: SIM115 - the server writes it for its life
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode} while starting:\n"
                    + self.log()[-3000:]
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not healthy after {start_timeout:g} s:\n"
                                   + self.log()[-3000:])
            time.sleep(0.5)
        m = re.search(r"engine core process started \(pid (\d+)\)", self.log())
        self.core_pid = int(m.group(1)) if m else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def _run_offline(model: str | None, rest: list[str], dataset: Path, num_prompts: int,
                 folder: Path, k: int, timeout: float) -> dict[str, Any]:
    """The offline engine on the same requests (`pagedkv bench throughput --dataset`), in a
    process of its own, so that only one engine holds the device at a time."""
    out = folder / f"offline_{k}.json"
    log = folder / f"offline_{k}.log"
    cmd = [
        sys.executable, "-m", "pagedkv.bench.throughput", *(["--model", model] if model else []),
        *rest, "--dataset", str(dataset), "--num-prompts", str(num_prompts),
        "--output-json", str(out), "--log-level", "WARNING",
    ]
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"the offline run failed (exit {done.returncode}):\n"
                           + log.read_text(errors="replace")[-3000:])
    return json.loads(out.read_text())


def _serve_run(server: _Server, args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    """Every request at once against `server`; the summary plus CPU shares and the server's
    TTFT split (means over this run, from its histograms)."""
    ns = argparse.Namespace(**{**vars(args), "base_url": server.url, "request_rate": None,
                               "stream": stream})
    cpu0 = (_cpu_seconds(server.proc.pid), _cpu_seconds(server.core_pid))
    before = _scrape(server.url)
    summary = asyncio.run(run_benchmark(ns))
    after = _scrape(server.url)
    cpu1 = (_cpu_seconds(server.proc.pid), _cpu_seconds(server.core_pid))
    wall = summary["duration_s"]
    for name, a, b in (("frontend", cpu0[0], cpu1[0]), ("core", cpu0[1], cpu1[1])):
        if a is not None and b is not None and wall > 0:
            summary[f"{name}_cpu_fraction"] = (b - a) / wall
    for key in _HISTOGRAMS:
        n = after.get(f"{key}_count", 0.0) - before.get(f"{key}_count", 0.0)
        if n > 0:
            total = after.get(f"{key}_sum", 0.0) - before.get(f"{key}_sum", 0.0)
            summary[f"server_mean_{key}_ms"] = total / n * 1000
    return summary


def _warm_server(server: _Server, args: argparse.Namespace) -> None:
    async def go() -> None:
        async with _client(args) as client:
            model = await _model_name(client, server.url, args)
            await _warm_up(client, server.url + args.endpoint, args, model, make_requests(args))

    asyncio.run(go())


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_compare_offline(
    args: argparse.Namespace, on_repeat: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """See the module docstring; returns the result. `on_repeat(result so far)` after each
    repeat."""
    model, rest = split_engine_args(args.engine_args)
    if args.vocab_size is None:  # no server yet: the model's own config says it
        from pagedkv.engine.config import ModelConfig

        args.vocab_size = ModelConfig.from_model(model, device="cpu").vocab_size
        _check_vocab(args)
    specs = make_requests(args)
    folder = Path(tempfile.mkdtemp(prefix="pagedkv-compare-"))
    dataset = folder / "requests.json"
    dataset.write_text(json.dumps(
        [{"prompt_token_ids": s.prompt, "output_len": s.output_len} for s in specs]
    ))
    offline: list[dict[str, Any]] = []
    streamed: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []

    def serve(k: int) -> None:
        server = _Server(model, rest, folder / f"server_{k}.log", args.server_start_timeout)
        try:
            if args.warmup_requests:
                _warm_server(server, args)
            for stream in ((True, False) if k % 2 == 0 else (False, True)):
                summary = _serve_run(server, args, stream)
                (streamed if stream else plain).append(summary)
                print(f"  repeat {k + 1}: server, {'streaming' if stream else 'non-streaming'}: "
                      f"{summary['output_throughput']:.1f} output tok/s "
                      f"({summary['completed']} ok, {summary['failed']} failed)", flush=True)
        finally:
            server.stop()

    result: dict[str, Any] = {}
    for k in range(args.repeats):
        steps = ("offline", "serve") if k % 2 == 0 else ("serve", "offline")
        for step in steps:
            if step == "serve":
                serve(k)
            else:
                run = _run_offline(model, rest, dataset, len(specs), folder, k,
                                   args.offline_timeout)
                offline.append(run)
                print(f"  repeat {k + 1}: offline engine: {run['output_tok_s']:.1f} output "
                      "tok/s", flush=True)
        result = _compare_result(args, specs, offline, streamed, plain)
        result["partial"] = k + 1 < args.repeats
        if on_repeat is not None:
            on_repeat(result)  # a run cut short keeps the repeats it finished
    return result


def _compare_result(args: argparse.Namespace, specs: list[RequestSpec],
                    offline: list[dict[str, Any]], streamed: list[dict[str, Any]],
                    plain: list[dict[str, Any]]) -> dict[str, Any]:
    off = [r["output_tok_s"] for r in offline]
    st = [r["output_throughput"] for r in streamed]
    ns_ = [r["output_throughput"] for r in plain]
    # The streaming run of median throughput gives the latency figures.
    mid = sorted(streamed, key=lambda r: r["output_throughput"])[len(streamed) // 2]
    result: dict[str, Any] = {
        "benchmark": "pagedkv bench serve --compare-offline",
        "model": mid["model"],
        "workload": args.workload,
        "num_prompts": len(specs),
        "total_input_tokens": sum(len(s.prompt) for s in specs),
        "total_output_tokens": sum(s.output_len for s in specs),
        "engine_args": args.engine_args,
        "repeats": len(off),
        "offline_output_tok_s": statistics.median(off),
        "serve_output_tok_s": statistics.median(st),
        "serve_over_offline": statistics.median(st) / statistics.median(off),
        "serve_nonstream_output_tok_s": statistics.median(ns_),
        "serve_nonstream_over_offline": statistics.median(ns_) / statistics.median(off),
        "spread": {
            "offline_output_tok_s": _spread(off),
            "serve_output_tok_s": _spread(st),
            "serve_nonstream_output_tok_s": _spread(ns_),
            "serve_over_offline_per_repeat": [s / o for s, o in zip(st, off)],
            "serve_nonstream_over_offline_per_repeat": [s / o for s, o in zip(ns_, off)],
        },
        "runs": {"offline": off, "serve": st, "serve_nonstream": ns_},
    }
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            result[f"{stat}_{key}_ms"] = mid[f"{stat}_{key}_ms"]
    result["failed"] = sum(r["failed"] for r in streamed + plain)
    split = {k: mid[f"server_mean_{k}_ms"] for k in _HISTOGRAMS if f"server_mean_{k}_ms" in mid}
    if {"ttft", "queue", "prefill"} <= split.keys():
        split["other_ms"] = split["ttft"] - split["queue"] - split["prefill"]
    result["ttft_split_ms"] = split
    for name in ("frontend", "core"):
        values = [r[f"{name}_cpu_fraction"] for r in streamed if f"{name}_cpu_fraction" in r]
        if values:
            result[f"{name}_cpu_fraction"] = statistics.median(values)
    for key in ("decode_step_ms", "decode_step_bound_ms", "num_gpu_blocks", "max_num_seqs"):
        if key in offline[0]:
            result[f"offline_{key}"] = statistics.median(r[key] for r in offline)
    env = environment()
    offline_env = offline[0].get("env") or {}
    result.update({"hardware": offline_env.get("gpu") or hardware(), "commit": env["commit"],
                   "command": env["command"], "env": env, "offline_env": offline_env})
    return result


def format_compare(r: dict[str, Any]) -> str:
    sp = r["spread"]
    lines = [
        "{s:{c}^72}".format(s=" Server vs offline engine (same requests, same options) ", c="="),
        f"{'':<28}{'median':>12}{'min':>12}{'max':>12}",
    ]
    for label, key in (("offline engine tok/s", "offline_output_tok_s"),
                       ("server, streaming tok/s", "serve_output_tok_s"),
                       ("server, non-streaming tok/s", "serve_nonstream_output_tok_s")):
        d = sp[key]
        lines.append(f"{label:<28}{d['median']:>12.1f}{d['min']:>12.1f}{d['max']:>12.1f}")
    lines.append(f"server / offline: streaming {r['serve_over_offline']:.3f}, non-streaming "
                 f"{r['serve_nonstream_over_offline']:.3f} (ratio of medians over "
                 f"{r['repeats']} interleaved repeats)")
    lines.append(f"streaming run of median throughput: TTFT mean {r['mean_ttft_ms']:.0f} ms, "
                 f"TPOT median {r['median_tpot_ms']:.1f} / P99 {r['p99_tpot_ms']:.1f} ms, "
                 f"ITL median {r['median_itl_ms']:.1f} / P99 {r['p99_itl_ms']:.1f} ms")
    split = r.get("ttft_split_ms") or {}
    if "other_ms" in split:
        lines.append(f"server TTFT {split['ttft']:.0f} ms = queued in the core "
                     f"{split['queue']:.0f} + prefill {split['prefill']:.0f} + intake and hops "
                     f"{split['other_ms']:.0f} (means)")
    if "frontend_cpu_fraction" in r:
        lines.append(f"CPU used while streaming: API process {r['frontend_cpu_fraction']:.2f} "
                     f"core(s), engine core {r.get('core_cpu_fraction', float('nan')):.2f}")
    lines.append("=" * 72)
    return "\n".join(lines)


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
    _check_dataset(args)
    _check_saturation(args)
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


def _json_ready(value: Any) -> Any:
    """Floats rounded for reading, inf as the string "inf" (JSON has no infinity)."""
    if isinstance(value, float):
        return "inf" if math.isinf(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    return value


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
        "options": _json_ready(options),
        "env": env,
    }


def _write_json(path: str, data: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_json_ready(data), indent=2) + "\n", encoding="utf-8")


def _print_header(args: argparse.Namespace) -> None:
    if args.request_rates is not None:
        rate = ", ".join(_rate(r) for r in args.request_rates) + " req/s (Poisson), a sweep"
    else:
        r = _single_rate(args)
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
            _write_json(args.result_json, {**record, "summary": summary, "rates": per_rate})
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
    print(json.dumps(_json_ready(line)))
    return 0 if any(s["completed"] > 0 for s in per_rate) else 1


def _run_compare_cli(args: argparse.Namespace) -> int:
    print(f"  compare with the offline engine: engine options {args.engine_args!r}, "
          f"{args.repeats} repeats, warm-up requests: {args.warmup_requests}", flush=True)
    setup = _setup(args)

    def save(result: dict[str, Any]) -> None:
        if args.result_json:
            _write_json(args.result_json, {"setup": setup, **result})

    result = run_compare_offline(args, on_repeat=save)
    print(format_compare(result))
    if args.result_json:
        print(f"  results: {args.result_json}")
    print(json.dumps(_json_ready({k: v for k, v in result.items() if k not in ("env",
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
        rate = _single_rate(args)
        _write_json(
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



# --- issue 19: `--dataset sharegpt`, the real ShareGPT V3 prompts (pagedkv.bench.sharegpt) ---
def add_dataset_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset",
        default=None,
        choices=("sharegpt",),
        help="sharegpt: real ShareGPT V3 prompts (token ids of the embedded model's tokenizer) "
        "and reply lengths, sampled by vLLM's rules with --seed; replaces --workload (needs "
        "pagedkv-bench[sharegpt])",
    )


def _check_dataset(args: argparse.Namespace) -> None:
    if getattr(args, "dataset", None) == "sharegpt":
        from pagedkv.bench.sharegpt import dataset_available, missing_dataset_message

        if not dataset_available():
            raise ValueError(f"--dataset sharegpt: {missing_dataset_message()}")


def _sharegpt_requests(args: argparse.Namespace) -> list[RequestSpec]:
    from pagedkv.bench.sharegpt import sample_requests

    specs = []
    for r in sample_requests(args.num_prompts, seed=args.seed):
        if max(r.prompt_token_ids) >= args.vocab_size:
            raise ValueError(
                f"--dataset sharegpt: token ids go past --vocab-size {args.vocab_size} (the "
                "embedded tokenizer has 49152)"
            )
        specs.append(RequestSpec(list(r.prompt_token_ids), r.output_len))
    return specs


# --- issue 21: below saturation. The batch the server ran at (sampled from its /metrics while
# a rate runs), the knee of the sweep, and median TPOT against the offline engine's decode step
# at the same batch size (measured by pagedkv.bench.decode_step after the server stops) ---

#: A rate *follows its offered load* when the normalized latency (s/token) of its last third of
#: requests, in arrival order, is at most this many times that of its first third. A server
#: that keeps up serves the late requests as it served the early ones; past the knee a backlog
#: (a queue, or a batch that keeps growing) builds up over the run, so the late requests wait.
#: Why not achieved / offered throughput: a run of a few hundred requests ends with a drain
#: (the last long requests, up to ~1,900 tokens for ShareGPT) of many seconds whatever the
#: load, which pulls that ratio far below 1 even where the server keeps up.
DEFAULT_KNEE_LATENCY_GROWTH = 1.5
#: Issue 21's goals below the knee: median TPOT within 1.3x the offline decode step at the same
#: batch size, and P99 inter-token latency within 100 ms.
TPOT_OVER_DECODE_STEP_GOAL = 1.3
P99_ITL_MS_GOAL = 100.0

_RUNNING_GAUGE = "vllm:num_requests_running"
_WAITING_GAUGE = "vllm:num_requests_waiting"

#: Per-rate figures of this part (the sweep's last JSON line carries them too).
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


def _check_saturation(args: argparse.Namespace) -> None:
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


async def _sample_gauges(
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


async def _measure_rate(
    client: httpx.AsyncClient,
    base: str,
    args: argparse.Namespace,
    model: str,
    specs: list[RequestSpec],
    rate: float,
) -> dict[str, Any]:
    """One rate of a sweep: `summarize`'s figures plus `rate_saturation`'s, the server's
    gauges sampled while the requests run. With `--duration-per-rate`, the first
    `rate_requests` of `specs`."""
    specs = specs[: rate_requests(len(specs), rate, args.duration_per_rate)]
    samples: list[tuple[float, float | None]] = []
    stop = asyncio.Event()
    sampler = None
    if args.metrics_period > 0:
        sampler = asyncio.ensure_future(
            _sample_gauges(client, base, args.metrics_period, samples, stop)
        )
    started_at = time.time()
    try:
        results, duration = await _send_all(client, base + args.endpoint, args, model, specs, rate)
    finally:
        stop.set()
        if sampler is not None:
            await sampler
    # The wall clock, so that the engine core's step trace can be cut per rate.
    summary = {"request_rate": rate, "num_requests": len(specs),
               "started_at": started_at, "ended_at": time.time(),
               **summarize(results, duration, model)}
    mean_out = statistics.fmean(s.output_len for s in specs)
    summary.update(rate_saturation(results, samples, rate * mean_out, args.knee_latency_growth))
    summary["output_over_offered"] = summary["output_throughput"] / summary["offered_output_tok_s"]
    return summary


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
        note = (f"even the lowest rate, {_rate(ordered[0]['request_rate'])} req/s, falls behind "
                "its offered load (or fails requests): test lower rates")
    elif first_past is None:
        status = "all_rates_follow"
        note = (f"every rate up to the highest tested, {_rate(knee)} req/s, follows its offered "
                "load: the knee is at least that; test higher rates")
    else:
        status = "crossed"
        note = (f"knee {_rate(knee)} req/s: the server keeps up to it and falls behind at "
                f"{_rate(first_past)} req/s")
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
    """The sweep JSON's top-level figures of this part: the knee and the worst TPOT ratio and
    P99 ITL of the rates up to it, with issue 21's goals."""
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
        batch = "/".join(_fmt(s.get(k), ".0f") for k in
                         ("batch_size_median", "batch_size_mean", "batch_size_max"))
        follows = {True: "yes", False: "no", None: "n/a"}[s.get("follows_offered_load")]
        lines.append(
            f"{_rate(s['request_rate']):>7} {_fmt(s.get('offered_output_tok_s'), '.0f'):>9} "
            f"{s['output_throughput']:>10.1f} {batch:>20} {_fmt(s.get('waiting_max'), 'd'):>8} "
            f"{s['median_tpot_ms']:>9.1f} {s['p99_itl_ms']:>8.1f} "
            f"{_fmt(s.get('latency_growth'), '.2f'):>7} {follows:>8} "
            f"{_fmt(s.get('offline_decode_step_ms'), '.2f'):>8} "
            f"{_fmt(s.get('tpot_over_decode_step'), '.2f'):>9}"
        )
    rec = saturation_record(per_rate, max_growth)
    lines.append("-" * len(head))
    lines.append(rec["knee"]["note"] + f" (latency growth bound {max_growth:g})")
    lines.append(
        "up to the knee: median TPOT / offline decode step at most "
        f"{_fmt(rec['tpot_over_decode_step_max_below_knee'], '.2f')} (goal <= "
        f"{TPOT_OVER_DECODE_STEP_GOAL:g}), P99 ITL at most "
        f"{_fmt(rec['p99_itl_ms_max_below_knee'], '.1f')} ms (goal <= {P99_ITL_MS_GOAL:g})"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
