"""Prometheus metrics under vLLM's names (`vllm:` prefix), so existing vLLM dashboards work.

Two sources:
- the engine's own counters and gauges (`engine.get_stats()`), read at scrape time by a custom
  collector: running / waiting / swapped requests, KV cache usage, preemptions, prompt and
  generation tokens, prefix-cache queries and hits;
- per-request latencies that only the server sees, as histograms: time to first token, time per
  output token, end-to-end latency, and the parts of the time to first token spent queued in
  the engine core and in prefill.

Every app gets its own `CollectorRegistry`, so two apps in one process (tests) never share or
collide on metrics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "vllm:"

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)

# (metric name without prefix, kind, help, EngineStats attribute names to try in order)
_ENGINE_METRICS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("num_requests_running", "gauge", "Requests in the running batch.", ("num_running",)),
    ("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", ("num_waiting",)),
    (
        "num_requests_swapped",
        "gauge",
        "Requests whose KV blocks are swapped out to host memory.",
        ("num_swapped",),
    ),
    (
        "gpu_cache_usage_perc",
        "gauge",
        "Fraction (0..1) of the device KV cache blocks in use (KV cache utilization).",
        ("gpu_kv_usage", "gpu_cache_usage"),
    ),
    (
        "kv_cache_usage_perc",
        "gauge",
        "Fraction (0..1) of the KV cache blocks in use (vLLM V1's name).",
        ("gpu_kv_usage", "gpu_cache_usage"),
    ),
    (
        "cpu_cache_usage_perc",
        "gauge",
        "Fraction (0..1) of the host swap blocks in use.",
        ("cpu_kv_usage", "cpu_cache_usage"),
    ),
    (
        "num_preemptions",
        "counter",
        "Preemptions (swap or recompute) since start.",
        ("num_preemptions", "num_preemptions_total", "preemptions"),
    ),
    (
        "prompt_tokens",
        "counter",
        "Prompt tokens processed (prefilled) since start.",
        ("prompt_tokens", "prompt_tokens_total", "num_prompt_tokens"),
    ),
    (
        "generation_tokens",
        "counter",
        "Tokens generated since start.",
        ("generation_tokens", "generation_tokens_total", "num_generation_tokens"),
    ),
    (
        "prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        ("prefix_cache_queries",),
    ),
    (
        "prefix_cache_hits",
        "counter",
        "Prompt tokens found in the prefix cache.",
        ("prefix_cache_hits",),
    ),
)


def _stat(stats: Any, names: tuple[str, ...]) -> float | None:
    for name in names:
        value = getattr(stats, name, None)
        if value is None and isinstance(stats, dict):
            value = stats.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


class EngineStatsCollector(Collector):
    """Reads `engine.get_stats()` at each scrape; a stat the engine lacks is simply not exported."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        config = getattr(self.engine, "model_config", None)
        info = {
            name: str(getattr(config, name))
            for name in ("block_size", "num_gpu_blocks", "num_cpu_blocks", "kv_capacity",
                         "max_num_seqs", "max_model_len")
            if getattr(config, name, None) is not None
        }
        if info:
            family = GaugeMetricFamily(
                PREFIX + "cache_config_info",
                "Information of the KV cache configuration (value 1, the settings as labels).",
                labels=sorted(info),
            )
            family.add_metric([info[k] for k in sorted(info)], 1.0)
            yield family
        get_stats = getattr(self.engine, "get_stats", None)
        stats = get_stats() if callable(get_stats) else None
        if stats is None:
            return
        for name, kind, doc, attrs in _ENGINE_METRICS:
            value = _stat(stats, attrs)
            if value is None:
                continue
            family_cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_cls(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family

    def describe(self) -> Iterable[Metric]:
        return []  # values come from the engine at scrape time; nothing to pre-register


class ServerMetrics:
    """The app's registry plus the latency histograms the server records per request."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(EngineStatsCollector(engine, model_name))
        labels = ["model_name"]
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between generated tokens of a request, after its first.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests that finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time a request waited in the engine core's queue before its first scheduling.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.prefill_time = Histogram(
            PREFIX + "request_prefill_time_seconds",
            "Time from a request's first scheduling to its first token reaching the server.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.request_aborted = Counter(
            PREFIX + "request_aborted",
            "Requests aborted: the client went away, or the request was aborted explicitly "
            "(never a rejected request).",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.inference_time = Histogram(
            PREFIX + "request_inference_time_seconds",
            "Time from a request's first scheduling to its end (prefill and decode).",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.decode_time = Histogram(
            PREFIX + "request_decode_time_seconds",
            "Time from a request's first token to its end.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two outputs with new tokens of a streamed request.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens",
            "Prompt tokens of each finished request.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Tokens generated by each finished request (all its sequences).",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.params_n = Histogram(
            PREFIX + "request_params_n",
            "The n of each finished request.",
            labels,
            buckets=(1, 2, 5, 10, 20),
            registry=self.registry,
        ).labels(model_name)
        self.params_max_tokens = Histogram(
            PREFIX + "request_params_max_tokens",
            "The max_tokens of each finished request (capped by the context).",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens_total",
            "Tokens sampled per engine step (one per running sequence; the step messages "
            "this server receives).",
            labels,
            buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
            registry=self.registry,
        ).labels(model_name)
        # The engine's step messages, where it offers them (AsyncLLMEngine.step_listeners).
        listeners = getattr(engine, "step_listeners", None)
        if isinstance(listeners, list):
            listeners.append(self.observe_step)

    def observe_step(self, msg: Any) -> None:
        tokens = getattr(msg, "token_ids", None)
        if tokens:
            self.iteration_tokens.observe(len(tokens))

    def observe_request(
        self,
        metrics: Any,
        *,
        prompt_tokens: int,
        generation_tokens: int,
        n: int,
        max_tokens: int | None,
    ) -> None:
        """A finished request's sizes, and where its time went: queued, prefill, then
        inference and decode after it was scheduled."""
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        if metrics is None:
            return
        self.observe_scheduling(metrics)
        end = getattr(metrics, "finished_time", None) or getattr(metrics, "last_token_time", None)
        scheduled = getattr(metrics, "first_scheduled_time", None)
        first = getattr(metrics, "first_token_time", None)
        if end is not None and scheduled is not None:
            self.inference_time.observe(max(0.0, end - scheduled))
        if end is not None and first is not None:
            self.decode_time.observe(max(0.0, end - first))

    def observe_finished(
        self,
        ttft: float | None,
        e2e: float,
        num_generated: int,
        finish_reasons: Iterable[str | None],
    ) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_generated > 1:
                self.tpot.observe((e2e - ttft) / (num_generated - 1))
        self.e2e.observe(e2e)
        for reason in finish_reasons:
            self.request_success.labels(self.model_name, reason or "unknown").inc()

    def observe_scheduling(self, metrics: Any) -> None:
        """Where a finished request's time to first token went, from the engine's
        `RequestMetrics`: queueing in the engine core, then prefill (the rest of the time to
        first token is the server's own intake and the hop to the core)."""
        if metrics is None:
            return
        queued = getattr(metrics, "time_in_queue", None)
        scheduled = getattr(metrics, "first_scheduled_time", None)
        first = getattr(metrics, "first_token_time", None)
        if queued is not None:
            self.queue_time.observe(max(0.0, queued))
        if scheduled is not None and first is not None:
            self.prefill_time.observe(max(0.0, first - scheduled))
