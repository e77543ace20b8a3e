"""The load generator of `pagedkv bench serve`: sends the requests to an OpenAI-compatible
server (as a Poisson process, or all at once) and times each one from its stream.

It times and counts; the figures are made from the `RequestResult`s it collects by
`pagedkv.bench.serve_report`. One run is `run_benchmark`; a sweep (`run_sweep`) sends the same
requests at each rate, and while a rate runs it also samples the server's running batch for
`pagedkv.bench.serve_saturation`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx

from pagedkv.bench.serve_report import summarize
from pagedkv.bench.serve_requests import RequestResult, RequestSpec, check_vocab, make_requests
from pagedkv.bench.serve_saturation import rate_requests, rate_saturation, sample_gauges


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


def http_client(args: argparse.Namespace) -> httpx.AsyncClient:
    """The client every request of a run goes through: no connection limit (the rate, not
    a pool, decides how many requests are in flight), the API key when one is given."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    return httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits)


async def model_name(client: httpx.AsyncClient, base: str, args: argparse.Namespace) -> str:
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
        check_vocab(args)
    return str(args.model) if args.model is not None else str(card["id"])


async def send_all(
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


def single_rate(args: argparse.Namespace) -> float:
    return math.inf if args.request_rate is None else float(args.request_rate)


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """One run at `--request-rate`; the summary of `summarize`."""
    base = args.base_url.rstrip("/")
    async with http_client(args) as client:
        model = await model_name(client, base, args)
        specs = make_requests(args)
        results, duration = await send_all(
            client, base + args.endpoint, args, model, specs, single_rate(args)
        )
    return summarize(results, duration, model)


async def warm_up(
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
    async with http_client(args) as client:
        model = await model_name(client, base, args)
        specs = make_requests(args)
        if args.warmup_requests:
            warm = await warm_up(client, url, args, model, specs)
            warmup_failed = sum(not r.ok for r in warm)
        for k, rate in enumerate(args.request_rates):
            if k and args.pause_between_rates > 0:
                await asyncio.sleep(args.pause_between_rates)
            summary = await _measure_rate(client, base, args, model, specs, rate)
            per_rate.append(summary)
            if on_rate is not None:
                on_rate(summary)
    return {"model": model, "warmup_failed": warmup_failed, "rates": per_rate}


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
            sample_gauges(client, base, args.metrics_period, samples, stop)
        )
    started_at = time.time()
    try:
        results, duration = await send_all(client, base + args.endpoint, args, model, specs, rate)
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
