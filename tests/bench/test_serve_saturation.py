"""The below-saturation figures of `bench serve --request-rates` (`pagedkv.bench.serve_saturation`):
the batch the server ran at (sampled from /metrics), the knee, the ratio of median TPOT to the
offline decode step (`pagedkv.bench.decode_step`), and `scripts/gpu_serve_sweep.sh` end to end
on the CPU."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.bench import decode_step, serve, serve_client, serve_requests, serve_saturation

REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_bench_serve_args(parser)
    if "--vocab-size" not in argv:  # no server to read it from
        argv = (*argv, "--vocab-size", "32000")
    return parser.parse_args(list(argv))


def _done(e2e: float, tokens: int = 10) -> serve_requests.RequestResult:
    return serve_requests.RequestResult(ok=True, output_tokens=tokens, ttft=0.01, e2e=e2e)


def _rate(rate: float, growth: float | None, failed: int = 0, **extra) -> dict:
    return {"request_rate": rate, "latency_growth": growth, "failed": failed,
            "completed": 10 - failed, "output_throughput": 100.0, **extra}


# ---- the batch size -------------------------------------------------------------------------


def test_token_weighted_median_by_hand() -> None:
    # 1 + 1 + 8 = 10 tokens a step: the 8s hold 8 of 10, so the median token is in a batch of 8
    assert serve_saturation.token_weighted_median([1, 1, 8]) == 8
    # 0s (an idle server) make no tokens; 3 + 3 = 6 of 10 tokens in batches of 3 or less
    assert serve_saturation.token_weighted_median([0, 0, 3, 3, 4]) == 3
    assert serve_saturation.token_weighted_median([]) is None
    assert serve_saturation.token_weighted_median([0, 0]) is None


@given(st.lists(st.integers(0, 1024), min_size=1, max_size=60))
def test_token_weighted_median_splits_the_tokens(values: list[int]) -> None:
    """Reference: expand every sample into one entry per token it made, take the lower median."""
    m = serve_saturation.token_weighted_median([float(v) for v in values])
    tokens = sorted(v for v in values for _ in range(v))
    if not tokens:
        assert m is None
        return
    assert m == tokens[(len(tokens) - 1) // 2]
    assert min(v for v in values if v > 0) <= m <= max(values)


def test_parse_gauges_sums_label_sets_and_skips_the_rest() -> None:
    page = (
        "# HELP vllm:num_requests_running Requests in the running batch.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 7.0\n'
        'vllm:num_requests_running{model_name="n"} 2.0\n'
        'vllm:num_requests_waiting{model_name="m"} 3.0\n'
        'vllm:num_requests_running_total{model_name="m"} 99.0\n'
        "vllm:generation_tokens_total 5.0\n"
    )
    assert serve_saturation.parse_gauges(page) == (9.0, 3.0)
    assert serve_saturation.parse_gauges("vllm:other 1\n") == (None, None)


def test_a_rate_samples_the_servers_running_batch() -> None:
    """A mock server whose /metrics says 4 running, 1 waiting: every figure of the rate comes
    from the samples, and the requests are the first rate x duration of the pool."""
    seen: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text="vllm:num_requests_running 4\n"
                                            "vllm:num_requests_waiting 1\n")
        seen.append(len(json.loads(request.content)["prompt"]))
        body = b"".join(
            b'data: {"choices": [{"text": "", "token_ids": [5]}]}\n\n' for _ in range(3)
        ) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=body)

    args = _args("--request-rates", "50", "--num-prompts", "20", "--duration-per-rate", "0.1",
                 "--metrics-period", "0.01", "--input-len", "4", "--output-len", "3")

    async def go() -> dict:
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(transport=transport) as client:
            specs = serve_requests.make_requests(args)
            return await serve_client._measure_rate(client, "http://x", args, "m", specs, 50.0)

    s = asyncio.run(go())
    assert len(seen) == s["num_requests"] == 5 == s["completed"]  # ceil(50 x 0.1)
    assert s["metrics_samples"] >= 1
    assert s["batch_size_median"] == 4 and s["batch_size_max"] == 4 and s["waiting_max"] == 1
    assert s["offered_output_tok_s"] == 50 * 3
    assert s["follows_offered_load"] in (True, False)


def test_rate_requests() -> None:
    assert serve_saturation.rate_requests(1000, 40, None) == 1000
    assert serve_saturation.rate_requests(1000, 40, 15) == 600
    assert serve_saturation.rate_requests(1000, 70, 15) == 1000
    assert serve_saturation.rate_requests(1000, 0.01, 15) == 1


# ---- the knee -------------------------------------------------------------------------------


def test_latency_growth_compares_the_last_third_with_the_first() -> None:
    # per-token latencies 0.1, 0.1, 0.1 | 0.2, 0.2, 0.2 | 0.3, 0.3, 0.3 -> 0.3 / 0.1
    results = [_done(e2e) for e2e in (1, 1, 1, 2, 2, 2, 3, 3, 3)]
    assert serve_saturation.latency_growth(results) == pytest.approx(3.0)
    failed = serve_requests.RequestResult(ok=False)
    growth = serve_saturation.latency_growth([_done(1), failed, _done(1), _done(2)])
    assert growth == pytest.approx(2)
    assert serve_saturation.latency_growth([_done(1), _done(2)]) is None


def test_knee() -> None:
    k = serve_saturation.knee_summary(
        [_rate(40, 1.1), _rate(10, 1.0), _rate(20, 1.2), _rate(60, 2.4), _rate(80, 1.2)], 1.5
    )
    # 80 follows again (a noisy point above the first crossing does not count)
    assert (k["knee_rate"], k["status"], k["first_rate_past_knee"]) == (40.0, "crossed", 60.0)
    k = serve_saturation.knee_summary([_rate(10, 1.0), _rate(20, 1.4)], 1.5)
    assert (k["knee_rate"], k["status"]) == (20.0, "all_rates_follow")
    k = serve_saturation.knee_summary([_rate(10, 1.9), _rate(20, 1.0)], 1.5)
    assert (k["knee_rate"], k["status"]) == (None, "lowest_rate_saturated")
    # failed requests, or too few to judge, end the run of rates that follow
    assert serve_saturation.knee_summary([_rate(10, 1.0), _rate(20, 1.0, failed=1)],
                                         1.5)["knee_rate"] == 10.0
    assert serve_saturation.knee_summary([_rate(10, 1.0), _rate(20, None)],
                                         1.5)["knee_rate"] == 10.0
    with pytest.raises(ValueError, match="at least one rate"):
        serve_saturation.knee_summary([], 1.5)
    with pytest.raises(ValueError, match=">= 1"):
        serve_saturation.knee_summary([_rate(10, 1.0)], 0.5)


def test_ratios_and_maxima_below_the_knee() -> None:
    per_rate = [
        _rate(10, 1.0, batch_size_median=8, median_tpot_ms=7.0, p99_itl_ms=30.0),
        _rate(20, 1.1, batch_size_median=32, median_tpot_ms=9.0, p99_itl_ms=80.0),
        _rate(40, 3.0, batch_size_median=256, median_tpot_ms=40.0, p99_itl_ms=900.0),
    ]
    rec = serve_saturation.saturation_record(per_rate, 1.5)
    assert rec["knee_rate"] == 20.0 and rec["p99_itl_ms_max_below_knee"] == 80.0
    assert rec["tpot_over_decode_step_max_below_knee"] is None  # no offline step yet
    serve_saturation.attach_decode_steps(per_rate, {8: 5.0, 32: 6.0, 256: 10.0, 999: 1.0})
    assert [s["tpot_over_decode_step"] for s in per_rate] == pytest.approx([1.4, 1.5, 4.0])
    rec = serve_saturation.saturation_record(per_rate, 1.5)
    assert rec["tpot_over_decode_step_max_below_knee"] == pytest.approx(1.5)  # not 4.0: past
    goals = rec["below_knee_goals"]
    assert goals["tpot_met"] is False and goals["p99_itl_met"] is True
    # a rate below the knee without an offline step: no maximum rather than a partial one
    del per_rate[0]["tpot_over_decode_step"]
    assert serve_saturation.saturation_record(per_rate, 1.5)[
        "tpot_over_decode_step_max_below_knee"] is None
    table = serve_saturation.format_saturation_table(per_rate, 1.5)
    assert "knee 20 req/s" in table and "at most 1.50" not in table


def test_saturation_options_are_checked() -> None:
    for argv, match in (
        (["--request-rates", "1,2", "--metrics-period", "-1"], "metrics-period"),
        (["--request-rates", "1,2", "--knee-latency-growth", "0.9"], "knee-latency-growth"),
        (["--request-rates", "1,2", "--duration-per-rate", "0"], "duration-per-rate"),
        (["--request-rate", "2", "--duration-per-rate", "5"], "goes with --request-rates"),
    ):
        with pytest.raises(ValueError, match=match):
            serve._check(_args(*argv))


# ---- the offline decode step ----------------------------------------------------------------


def test_decode_context_is_the_mean_over_generated_tokens() -> None:
    specs = [serve_requests.RequestSpec([1] * 10, 3), serve_requests.RequestSpec([1] * 100, 1)]
    # contexts of the generated tokens: 10, 11, 12 and 100
    assert decode_step.decode_context(specs) == pytest.approx((10 + 11 + 12 + 100) / 4)
    with pytest.raises(ValueError, match="no tokens"):
        decode_step.decode_context([serve_requests.RequestSpec([1], 0)])


def test_sweep_inputs_and_batch_sizes_are_checked() -> None:
    assert decode_step.parse_sizes("64,1, 256") == [64, 1, 256]
    for bad in ("a,b", "0,4", ""):
        with pytest.raises(ValueError, match="--batch-sizes"):
            decode_step.parse_sizes(bad)
    options = vars(_args("--input-len", "10", "--output-len", "3", "--num-prompts", "2"))
    data = {"setup": {"options": options},
            "rates": [{"batch_size_median": 5}, {"batch_size_median": None},
                      {"batch_size_median": 2}, {"batch_size_median": 5}]}
    assert decode_step.sweep_inputs(data) == ([2, 5], pytest.approx(11.0), 1.5)
    data["rates"] = [{"batch_size_median": None}]
    with pytest.raises(ValueError, match="no batch sizes"):
        decode_step.sweep_inputs(data)


@pytest.mark.slow
def test_the_sweep_script_runs_on_the_cpu(tmp_path) -> None:
    """`scripts/gpu_serve_sweep.sh` with the embedded model: two short rates, then the offline
    decode steps at their batch sizes; the JSON has every per-rate and top-level figure."""
    out = tmp_path / "out"
    env = {
        **os.environ, "OUT": str(out), "PYTHON": sys.executable, "MODEL": "", "SKIP_WHEELS": "1",
        "SERVE_ARGS": "--skip-tokenizer-init --kv-cache-gb 0.25 --max-num-seqs 8",
        "RATES": "4,8", "NUM_PROMPTS": "6", "DURATION_S": "0.75", "VOCAB_SIZE": "49152",
        "WARMUP_REQUESTS": "1", "PAUSE_S": "0", "PORT": str(_free_port()),
        "BENCH_EXTRA": "--workload random --input-len 8 --output-len 3 --metrics-period 0.05",
        "DECODE_EXTRA": "--steps 3 --warmup-steps 1", "BUDGET_S": "400",
        "DECODE_RESERVE_S": "60", "STEP_TRACE": "1",
    }
    env.pop("PAGEDKV_GPU_ENV", None)
    done = subprocess.run(["bash", "scripts/gpu_serve_sweep.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=420)
    print(done.stdout[-4000:], done.stderr[-2000:])
    assert done.returncode == 0
    data = json.loads((out / "serve_sweep_llama3_8b.json").read_text())
    assert [s["num_requests"] for s in data["rates"]] == [3, 6]
    measured = {m["batch_size"]: m["median_step_ms"] for m in data["offline_decode"]["by_batch"]}
    for s in data["rates"]:
        assert s["completed"] == s["num_requests"] and s["failed"] == 0
        assert 1 <= s["batch_size_median"] <= 8
        assert s["offline_decode_step_ms"] == measured[s["batch_size_median"]] > 0
        assert s["tpot_over_decode_step"] == pytest.approx(
            s["median_tpot_ms"] / s["offline_decode_step_ms"], rel=1e-3)
    rec = serve_saturation.saturation_record(data["rates"], 1.5)
    for key in ("knee_rate", "tpot_over_decode_step_max_below_knee", "p99_itl_ms_max_below_knee"):
        assert data[key] == (pytest.approx(rec[key], rel=1e-3) if rec[key] else rec[key])
    assert (out / "serve_sweep_llama3_8b_decode_step.log").exists()
    # STEP_TRACE=1: the engine core traced its steps, and each rate says where they went.
    lines = [json.loads(x) for x in
             (out / "serve_sweep_llama3_8b_steps.jsonl").read_text().splitlines()]
    assert lines
    # after the first, every line has the loop's own phases: reading inputs, sending outputs
    assert all(x["inputs"] >= 0 and x["send"] >= 0 for x in lines[1:])
    for s in data["rates"]:
        assert s["started_at"] < s["ended_at"]
        assert s["steps"]["num_steps"] >= 1 and 0 < s["steps"]["prefill_step_share"] <= 1


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_step_trace_is_cut_per_rate_and_split_by_step_kind(tmp_path) -> None:
    """`pagedkv.bench.step_trace`: per rate window, decode-only and prefill step intervals
    (the time since the step before ended), shares and the CLI's --write."""
    from pagedkv.bench import step_trace

    def step(t, decode, prefill, asynchronous=True):
        return {"t": t, "decode": decode, "prefill_tokens": prefill,
                **({"wait": 1.0} if asynchronous else {"execute": 1.0})}

    steps = [step(0.5, 0, 10, False),  # before the first rate: only the previous step's end
             step(1.00, 2, 0), step(1.01, 2, 0), step(1.05, 2, 30, False), step(1.06, 3, 0),
             step(5.0, 1, 0)]  # after it
    row = step_trace.summarize_window(steps, 1.0, 2.0)
    assert row["num_steps"] == 4 and row["steps_per_s"] == 4.0
    assert row["prefill_step_share"] == 0.25 and row["async_step_share"] == 0.75
    assert row["decode_step_interval_ms_median"] == pytest.approx(10.0)  # 500, 10, 10 ms
    assert row["prefill_step_interval_ms_median"] == pytest.approx(40.0)
    assert row["prefill_tokens_median"] == 30
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(s) + "\n" for s in steps) + '{"t": 9, "dec')  # cut short
    assert len(step_trace.read_trace(trace)) == len(steps)
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"rates": [{"request_rate": 4, "started_at": 1.0,
                                            "ended_at": 2.0}]}))
    assert step_trace.main([str(trace), "--sweep-json", str(sweep), "--write"]) == 0
    assert json.loads(sweep.read_text())["rates"][0]["steps"]["num_steps"] == 4
    sweep.write_text(json.dumps({"rates": [{"request_rate": 4}]}))
    before = sweep.read_text()
    with pytest.raises(SystemExit):
        step_trace.main([str(trace), "--sweep-json", str(sweep), "--write"])
    assert sweep.read_text() == before  # nothing written
