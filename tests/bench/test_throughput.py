"""`pagedkv bench throughput` and `pagedkv bench sharing` (pagedkv.bench.throughput, .sharing),
run in-process through the `pagedkv` command on the embedded model with tiny workloads."""

from __future__ import annotations

import json

import pytest

from pagedkv.bench import sharing, throughput
from pagedkv.engine.cli import main

SMALL = ["--device", "cpu", "--kv-cache-gb", "0.05", "--swap-space", "0.01"]


@pytest.mark.slow
def test_bench_throughput_against_transformers(capsys, tmp_path):
    saved = tmp_path / "workload.json"
    rc = main(["bench", "throughput", "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
               "--baseline", "hf", "--baseline", "hf-cb", "--hf-batch-sizes", "1,2",
               "--hf-num-prompts", "2", "--save-workload", str(saved), *SMALL])
    assert rc == 0
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["output_tokens"] == 12 and last["output_tok_s"] > 0
    assert last["hf_num_prompts"] == 2
    # A static batch size only when a static batch was the best baseline.
    static = last["hf_best_system"].startswith("generate, static batch")
    assert last.get("hf_best_batch_size") in ((1, 2) if static else (None,))
    assert last["hf_best_output_tok_s"] > 0 and last["ratio_vs_hf"] == pytest.approx(
        last["output_tok_s"] / last["hf_best_output_tok_s"])
    assert last["ratio_vs_hf_same_requests"] == pytest.approx(
        last["subset_output_tok_s"] / last["hf_best_output_tok_s"])
    assert last["hf_cb_output_tok_s"] > 0, last.get("hf_cb_error")
    # The best baseline is whichever transformers mode was faster.
    assert last["hf_best_output_tok_s"] >= last["hf_cb_output_tok_s"]
    assert last["hf_best_system"].startswith(("generate, static batch", "continuous batching"))
    assert "hf generate (batch 1)" in out and "hf generate (batch 2)" in out
    rows = json.loads(saved.read_text())
    assert [r["output_len"] for r in rows] == [4, 4, 4]
    assert all(len(r["prompt_token_ids"]) == 8 for r in rows)

    # The saved file replays the very same requests.
    rc = main(["bench", "throughput", "--num-prompts", "3", "--dataset", str(saved), *SMALL])
    assert rc == 0
    replay = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert replay["prompt_tokens"] == 24 and replay["output_tokens"] == 12
    assert "roofline_frac" not in replay  # a CPU run has no roofline


@pytest.mark.slow
def test_bench_throughput_transformers_time_limit(capsys):
    """A time-limited transformers trial counts the tokens it made (each request's only up to
    its own length) over the time it ran, and says it was cut."""
    rc = main(["bench", "throughput", "--num-prompts", "2", "--input-len", "8", "--output-len",
               "48", "--baseline", "hf", "--hf-batch-sizes", "2", "--hf-time-limit", "0.05",
               *SMALL])
    assert rc == 0
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["hf_best_stopped_at_time_limit"] is True
    assert last["hf_best_output_tok_s"] > 0
    assert "hf generate (batch 2), time limit" in out


@pytest.mark.slow
def test_bench_sharing_reports_savings(capsys):
    rc = main(["bench", "sharing", "--widths", "2", "--max-tokens", "12", *SMALL])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < last["parallel_2_saving_pct"] < 100 and 0 < last["beam_2_saving_pct"] < 100


@pytest.mark.slow
def test_python_m_runs_the_same_benchmarks(capsys):
    """`python -m pagedkv.bench.throughput|sharing` (the GPU scripts' form, where no entry point
    is installed) take the same options and print the same JSON line."""
    rc = throughput.main(["--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                          "--log-level", "WARNING", *SMALL])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["output_tokens"] == 6 and last["num_prompts"] == 2
    env = last["env"]
    assert {"python", "platform", "commit", "command", "packages", "torch"} <= set(env)
    assert env["packages"]["pagedkv-engine"] and env["packages"]["pagedkv-bench"]
    rc = sharing.main(["--widths", "2", "--max-tokens", "6", "--skip-beam", *SMALL])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(last) == {"parallel_2_saving_pct"}


def test_python_m_bad_option_is_a_clear_error(capsys):
    assert throughput.main(["--num-prompts", "1", "--workload", "sharegpt", "--max-model-len",
                            "-3", *SMALL]) == 2
    assert "pagedkv bench throughput: error:" in capsys.readouterr().err


def test_allocator_calls_counts_the_driver_calls_inside_the_block(monkeypatch):
    """`allocator_calls` reports how many cudaMalloc / cudaFree / retries the caching allocator
    made inside the block (from `torch.cuda.memory_stats`), and nothing off CUDA."""
    import types

    import torch

    from pagedkv.bench.common import ALLOCATOR_COUNTERS, allocator_calls

    with allocator_calls(torch.device("cpu")) as calls:
        pass
    assert calls == {}
    stats = {"num_device_alloc": 10, "num_device_free": 4, "num_alloc_retries": 0, "other": 7}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    with allocator_calls(types.SimpleNamespace(type="cuda")) as calls:
        assert calls == {}  # filled in when the block ends
        stats.update(num_device_alloc=13, num_device_free=5, num_alloc_retries=1)
    assert calls == {"num_device_alloc": 3, "num_device_free": 1, "num_alloc_retries": 1}
    assert set(calls) == set(ALLOCATOR_COUNTERS)
