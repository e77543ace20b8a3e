"""`pagedkv bench serve` (`pagedkv.bench.serve`) against the live CPU server: it prints vLLM's
table and ends with one JSON line whose figures agree with the run (every request completed,
latencies ordered)."""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess

import pytest

from pagedkv.bench import serve, serve_client, serve_compare, serve_report, serve_requests

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
        # no --vocab-size: read from the served model (49152); ids at or above 40000 would be
        # refused by any default below the real vocabulary
        "--min-token-id",
        "40000",
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
    serve.add_bench_serve_args(parser)
    args = parser.parse_args(
        [
            "--base-url",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--vocab-size",
            "1000",
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

    summary = asyncio.run(serve_client.run_benchmark(args))
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert summary["errors"]


def test_workload_lengths_and_percentiles() -> None:
    parser = argparse.ArgumentParser()
    serve.add_bench_serve_args(parser)
    args = parser.parse_args(["--workload", "alpaca", "--num-prompts", "2000", "--seed", "3",
                              "--vocab-size", "49152"])
    specs = serve_requests.make_requests(args)
    assert specs == serve_requests.make_requests(args)  # the seed fixes everything
    mean_in = sum(len(s.prompt) for s in specs) / len(specs)
    mean_out = sum(s.output_len for s in specs) / len(specs)
    assert 15 < mean_in < 24 and 48 < mean_out < 70
    assert all(100 <= t < 49152 for s in specs[:50] for t in s.prompt)
    values = [random.random() for _ in range(101)]
    ordered = sorted(values)
    assert serve_report.percentile(values, 50) == ordered[50]
    assert serve_report.percentile(values, 99) == pytest.approx(ordered[99])
    assert serve_report.percentile([], 99) == 0.0
    assert not math.isnan(serve_report.percentile([1.0], 99))


# ---- tokenizer-free servers and the request-rate sweep ---------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_bench_serve_args(parser)
    return parser.parse_args(list(argv))


def _sse(*events: dict) -> bytes:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return body.encode()


def _stream_result(body: bytes) -> serve_requests.RequestResult:
    import asyncio

    import httpx

    async def go() -> serve_requests.RequestResult:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            spec = serve_requests.RequestSpec([1, 2, 3], 5)
            return await serve_client._one_request(
                client, "http://x/v1/completions", _args(), "m", spec
            )

    return asyncio.run(go())


def test_chunks_with_token_ids_count_as_that_many_tokens() -> None:
    """A server without a tokenizer streams empty text and token ids: still tokens."""
    chunk = lambda ids: {"choices": [{"index": 0, "text": "", "token_ids": ids}]}  # noqa: E731
    r = _stream_result(_sse(chunk([5, 6]), chunk([7]), chunk([8, 9])))
    assert r.ok and r.output_tokens == 5 and len(r.itl) == 2 and 0 < r.ttft <= r.e2e
    # a text-only chunk is one token; the usage chunk, when sent, is exact
    text = {"choices": [{"index": 0, "text": "ab"}]}
    assert _stream_result(_sse(text, text)).output_tokens == 2
    usage = {"choices": [], "usage": {"completion_tokens": 7}}
    assert _stream_result(_sse(chunk([5, 6]), usage)).output_tokens == 7
    # nothing but empty text is no token at all
    empty = _stream_result(_sse({"choices": [{"index": 0, "text": ""}]}))
    assert not empty.ok and empty.error == "no tokens streamed"


def _done(e2e: float, tokens: int, ttft: float = 0.1) -> serve_requests.RequestResult:
    return serve_requests.RequestResult(
        ok=True, prompt_len=4, output_tokens=tokens, ttft=ttft, e2e=e2e
    )


def test_normalized_latency_is_the_mean_of_each_requests_latency_per_token() -> None:
    failed = serve_requests.RequestResult(error="x")
    results = [_done(2.0, 10), _done(1.0, 4), _done(0.3, 1), failed]
    s = serve_report.summarize(results, duration=4.0, model="m")
    # (2/10 + 1/4 + 0.3/1) / 3, not total latency / total tokens (3.3 / 15 = 0.22)
    assert s["normalized_latency_s_per_token"] == pytest.approx((0.2 + 0.25 + 0.3) / 3)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["output_throughput"] == pytest.approx(15 / 4.0)
    none = serve_report.summarize([serve_requests.RequestResult(error="x")], 1.0, "m")
    assert none["normalized_latency_s_per_token"] is None


def _rate(rate: float, norm: float | None, failed: int = 0) -> dict:
    return {
        "request_rate": rate,
        "normalized_latency_s_per_token": norm,
        "completed": 0 if norm is None else 10,
        "failed": failed,
    }


def test_sustainable_rate() -> None:
    summary = serve_report.sweep_summary
    # given in any order; the bound falls between 4 and 8
    s = summary([_rate(8, 0.5), _rate(1, 0.05), _rate(4, 0.19), _rate(2, 0.06)], 0.2)
    assert (s["sustainable_rate"], s["first_rate_over_bound"], s["status"]) == (4, 8, "crossed")
    assert s["latency_bound_s_per_token"] == 0.2
    # exactly at the bound is within it
    assert summary([_rate(1, 0.2), _rate(2, 0.3)], 0.2)["sustainable_rate"] == 1
    # even the lowest rate exceeds the bound
    s = summary([_rate(1, 0.25), _rate(2, 0.5)], 0.2)
    assert s["sustainable_rate"] is None and s["status"] == "lowest_rate_exceeds_bound"
    assert "lowest rate, 1 req/s" in s["note"] and "noisy" not in s["note"]
    s = summary([_rate(1, 0.25), _rate(2, 0.1)], 0.2)
    assert s["sustainable_rate"] is None and s["highest_rate_within_bound"] == 2
    assert "noisy" in s["note"]
    # every rate within: the sustainable rate is at least the highest tested
    s = summary([_rate(1, 0.01), _rate(2, 0.02)], 0.2)
    assert s["sustainable_rate"] == 2 and s["status"] == "all_rates_within_bound"
    assert s["first_rate_over_bound"] is None and "test higher rates" in s["note"]
    # failed requests or nothing completed: that rate is not sustained
    s = summary([_rate(1, 0.01), _rate(2, 0.02, failed=1), _rate(4, 0.03)], 0.2)
    assert s["sustainable_rate"] == 1 and s["first_rate_over_bound"] == 2
    # a noisy point above the first crossing does not raise the sustainable rate
    assert s["highest_rate_within_bound"] == 4 and "noisy" in s["note"]
    assert summary([_rate(1, None)], 0.2)["sustainable_rate"] is None
    with pytest.raises(ValueError, match="at least one rate"):
        summary([], 0.2)
    with pytest.raises(ValueError, match="> 0"):
        summary([_rate(1, 0.1)], 0.0)


def test_rates_and_sweep_options_are_checked() -> None:
    assert serve.parse_rates("8, 2,4,2") == [2.0, 4.0, 8.0]
    for bad, match in (
        ("1,x", "not a number"),
        ("0,1", "> 0"),
        ("1,inf", "finite"),
        (",", "at least"),
    ):
        with pytest.raises(ValueError, match=match):
            serve.parse_rates(bad)
    assert _args("--request-rates", "1,2").request_rates == [1.0, 2.0]
    for argv, match in (
        (["--request-rates", "1,2", "--request-rate", "3"], "not both"),
        (["--plot", "x.png"], "--request-rates"),
        (["--request-rates", "1", "--latency-bound", "0"], "latency-bound"),
        (["--request-rates", "1", "--pause-between-rates", "-1"], "pause"),
        (["--request-rates", "1", "--warmup-requests", "-1"], "warmup"),
    ):
        with pytest.raises(ValueError, match=match):
            serve._check(_args(*argv))


@pytest.mark.slow
def test_request_rate_sweep_against_the_tokenizer_free_server(tokfree_server, tmp_path) -> None:
    """Two rates, a few short requests, on the server without a tokenizer: every figure of the
    last JSON line agrees with the run and with the summary math."""
    result_json, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    cmd = [
        *pagedkv_command(),
        "bench",
        "serve",
        "--base-url",
        tokfree_server.url,
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--num-prompts",
        "4",
        "--request-rates",
        "8,4",
        "--latency-bound",
        "0.2",
        "--vocab-size",
        "49152",
        "--result-json",
        str(result_json),
        "--plot",
        str(plot),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert sum(line.startswith("Mean normalized latency (s/token):") for line in lines) == 2
    assert any(line.startswith("latency bound 0.2 s/token:") for line in lines)
    out = json.loads(lines[-1])
    assert [r["request_rate"] for r in out["rates"]] == [4.0, 8.0]
    for r in out["rates"]:
        assert r["completed"] == 4 and r["failed"] == 0
        # every request generates 4 tokens (ignore_eos): latency per token is e2e / 4
        assert r["normalized_latency_s_per_token"] == pytest.approx(
            r["mean_e2el_ms"] / 1000 / 4, rel=1e-3, abs=1e-4
        )
        assert r["output_throughput"] == pytest.approx(4 * r["request_throughput"], rel=1e-2)
        assert 0 < r["mean_ttft_ms"] <= r["mean_e2el_ms"] and r["median_tpot_ms"] > 0
    expected = serve_report.sweep_summary(out["rates"], 0.2)
    for key in ("sustainable_rate", "status", "first_rate_over_bound", "latency_bound_s_per_token"):
        assert out[key] == expected[key]
    saved = json.loads(result_json.read_text())
    assert saved["summary"]["status"] == out["status"] and len(saved["rates"]) == 2
    assert saved["setup"]["options"]["request_rates"] == [4.0, 8.0]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- non-streaming requests and the comparison with the offline engine ----------------------


def test_non_streaming_request_counts_usage_and_has_no_tpot() -> None:
    import asyncio

    import httpx

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] is False and "stream_options" not in body
        return httpx.Response(200, json={"choices": [{"text": "abc"}],
                                         "usage": {"completion_tokens": 5}})

    async def go() -> serve_requests.RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            spec = serve_requests.RequestSpec([1, 2, 3], 5)
            return await serve_client._one_request(
                client, "http://x/v1/completions", _args("--no-stream"), "m", spec
            )

    r = asyncio.run(go())
    assert r.ok and r.output_tokens == 5 and not r.streamed and r.ttft == r.e2e > 0
    s = serve_report.summarize([r], 1.0, "m")
    assert s["mean_tpot_ms"] == 0.0 and s["output_throughput"] == 5.0  # no TPOT without a stream


def test_engine_args_are_split_and_checked_before_anything_starts() -> None:
    model, rest = serve_compare.split_engine_args(
        "--model some/path --max-num-seqs 8 --kv-cache-gb 0.5 --skip-tokenizer-init"
    )
    assert model == "some/path"
    assert rest == ["--max-num-seqs", "8", "--kv-cache-gb", "0.5", "--skip-tokenizer-init"]
    assert serve_compare.split_engine_args("--model=x --block-size 16") == (
        "x", ["--block-size", "16"])
    assert serve_compare.split_engine_args("") == (None, [])
    for bad, match in (
        ("--max-num-seqs 0", "max_num_seqs"),
        ("--no-such-option 1", "not an engine option"),
        ("--block-size 7", "block"),
    ):
        with pytest.raises(ValueError, match=match):
            serve_compare.split_engine_args(bad)
    for argv, match in (
        (["--compare-offline", "--request-rate", "2"], "every request at once"),
        (["--compare-offline", "--repeats", "0"], "repeats"),
        (["--engine-args", "--max-num-seqs 4"], "goes with --compare-offline"),
        (["--compare-offline", "--engine-args", "--max-num-seqs -1"], "max_num_seqs"),
    ):
        with pytest.raises(ValueError, match=match):
            serve._check(_args(*argv))


@pytest.mark.slow
def test_compare_offline_runs_both_on_the_same_requests(tmp_path) -> None:
    """One repeat on the embedded model: the offline engine and the server (streaming and
    not) produce every requested token, and the ratios are those of the measured rates."""
    result_json = tmp_path / "cmp.json"
    cmd = [
        *pagedkv_command(), "bench", "serve", "--compare-offline", "--repeats", "1",
        "--engine-args", "--kv-cache-gb 0.25 --swap-space 0.05 --max-num-seqs 8",
        "--input-len", "8", "--output-len", "4", "--num-prompts", "6", "--vocab-size", "49152",
        "--result-json", str(result_json),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["failed"] == 0 and out["num_prompts"] == 6 and out["total_output_tokens"] == 24
    for key in ("offline_output_tok_s", "serve_output_tok_s", "serve_nonstream_output_tok_s"):
        assert out[key] > 0
    assert out["serve_over_offline"] == pytest.approx(
        out["serve_output_tok_s"] / out["offline_output_tok_s"], rel=1e-3)
    assert out["serve_nonstream_over_offline"] == pytest.approx(
        out["serve_nonstream_output_tok_s"] / out["offline_output_tok_s"], rel=1e-3)
    assert out["p99_tpot_ms"] >= out["median_tpot_ms"] > 0 and out["p99_itl_ms"] > 0
    split = out["ttft_split_ms"]
    assert split["queue"] >= 0 and split["prefill"] > 0
    assert split["other_ms"] == pytest.approx(  # each figure is rounded to 4 decimals
        split["ttft"] - split["queue"] - split["prefill"], abs=1e-3)
    assert out["commit"] and "--compare-offline" in out["command"]
    saved = json.loads(result_json.read_text())
    assert saved["serve_output_tok_s"] == pytest.approx(out["serve_output_tok_s"], rel=1e-3)
    assert saved["offline_env"]["packages"]["pagedkv-engine"]
