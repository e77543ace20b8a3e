"""`pagedkv bench serve` against the live CPU server: it prints vLLM's table and ends with one
JSON line whose figures agree with the run (every request completed, latencies ordered)."""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess

import pytest

from pagedkv.server import bench_serve

from .conftest import RunningServer, pagedkv_command


@pytest.mark.slow
def test_bench_serve_against_cpu_server(server: RunningServer) -> None:
    cmd = [
        *pagedkv_command(),
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--num-prompts",
        "8",
        "--request-rate",
        "inf",
        "--max-concurrency",
        "4",
        "--vocab-size",
        "49152",
        "--seed",
        "0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    for label in (
        "Successful requests:",
        "Request throughput (req/s):",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
        "Mean E2EL (ms):",
    ):
        assert any(line.startswith(label) for line in lines), label
    result = json.loads(lines[-1])
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    # 8 tokens per request (ignore_eos): output throughput is 8 x request throughput.
    assert result["output_throughput"] == pytest.approx(8 * result["request_throughput"], rel=1e-2)
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["median_tpot_ms"] > 0 and result["p99_itl_ms"] > 0


def test_bench_serve_failed_requests_are_counted() -> None:
    """A server that is not there: every request fails, none is counted as completed."""
    parser = argparse.ArgumentParser()
    bench_serve.add_bench_serve_args(parser)
    args = parser.parse_args(
        [
            "--base-url",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--num-prompts",
            "3",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--timeout",
            "5",
        ]
    )
    import asyncio

    summary = asyncio.run(bench_serve.run_benchmark(args))
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert summary["errors"]


def test_workload_lengths_and_percentiles() -> None:
    parser = argparse.ArgumentParser()
    bench_serve.add_bench_serve_args(parser)
    args = parser.parse_args(["--workload", "alpaca", "--num-prompts", "2000", "--seed", "3"])
    specs = bench_serve.make_requests(args)
    assert specs == bench_serve.make_requests(args)  # the seed fixes everything
    mean_in = sum(len(s.prompt) for s in specs) / len(specs)
    mean_out = sum(s.output_len for s in specs) / len(specs)
    assert 15 < mean_in < 24 and 48 < mean_out < 70
    assert all(100 <= t < 32000 for s in specs[:50] for t in s.prompt)
    values = [random.random() for _ in range(101)]
    ordered = sorted(values)
    assert bench_serve._pct(values, 50) == ordered[50]
    assert bench_serve._pct(values, 99) == pytest.approx(ordered[99])
    assert bench_serve._pct([], 99) == 0.0
    assert not math.isnan(bench_serve._pct([1.0], 99))
