"""The roofline arithmetic of the throughput benchmark, checked by hand on a known shape."""

from __future__ import annotations

import pytest
import torch

from pagedkv.bench.roofline import Hardware, ModelCost, roofline_report
from pagedkv.engine.config import ModelConfig
from pagedkv.engine.model_loader import load_model


@pytest.fixture(scope="module")
def llama8b():
    cfg = ModelConfig.from_model("meta-llama/Meta-Llama-3-8B", load_format="dummy",
                                 dtype="bfloat16", device="cpu")
    model = load_model(cfg, load_format="dummy", device="meta")
    return cfg, ModelCost.of(model, cfg, cfg.kv_bytes_per_token())


def test_model_cost_of_llama3_8b(llama8b) -> None:
    _, cost = llama8b
    embed = lm_head = 128256 * 4096
    assert cost.lm_head_params == lm_head
    assert cost.matmul_params == 8_030_261_248 - embed - lm_head
    assert cost.weight_bytes == (8_030_261_248 - embed) * 2  # bf16, LM head included
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads
    assert cost.attn_flops_per_pair == 4 * 32 * 32 * 128


def test_pass_bound_is_memory_bound_for_decode_and_compute_bound_for_prefill(llama8b) -> None:
    _, cost = llama8b
    hw = Hardware(bandwidth=4e12, matmul_flops=800e12)
    # decode: 256 sequences of 500 tokens each
    decode = cost.pass_bound(hw, 256, 256, 256 * 500, 256 * 500)
    assert decode == pytest.approx((cost.weight_bytes + (256 * 500 + 256) * 131072) / 4e12)
    # prefill: one 4096-token prompt
    pairs = 4096 * 4097 // 2
    prefill = cost.pass_bound(hw, 4096, 1, 4096, pairs)
    flops = 2 * cost.matmul_params * 4096 + 2 * cost.lm_head_params + cost.attn_flops_per_pair * pairs
    assert prefill == pytest.approx(flops / 800e12)


def test_serial_bound_adds_the_matmuls_and_attention_each_at_its_limit(llama8b) -> None:
    """384 sequences of 500 tokens (a large decode pass): the matmuls are compute-bound and
    attention memory-bound, so the serial bound is the sum of the two, above the overlapped
    bound (the larger of all bytes and all products); one sequence: both memory-bound, and
    the two bounds agree."""
    _, cost = llama8b
    hw = Hardware(bandwidth=4e12, matmul_flops=800e12)
    b, ctx = 384, 500
    matmul = (2 * cost.matmul_params * b + 2 * cost.lm_head_params * b) / 800e12
    weights = cost.weight_bytes / 4e12
    kv = (b * ctx + b) * cost.kv_bytes_per_token / 4e12
    attention = cost.attn_flops_per_pair * b * ctx / 800e12
    assert matmul > weights and kv > attention
    serial = cost.pass_serial_bound(hw, b, b, b * ctx, b * ctx)
    assert serial == pytest.approx(matmul + kv)
    overlapped = cost.pass_bound(hw, b, b, b * ctx, b * ctx)
    assert overlapped == pytest.approx(max(weights + kv, matmul + attention)) and overlapped < serial
    one = (1, 1, 1500, 1500)
    assert cost.pass_serial_bound(hw, *one) == pytest.approx(cost.pass_bound(hw, *one))
    report = roofline_report(cost, hw, [(b, b, b * ctx, b * ctx)], [2 * serial], 2 * serial,
                             gpu_seconds=[2 * serial])  # fmt: skip
    assert report["roofline_serial_frac"] == pytest.approx(0.5)
    assert report["roofline_serial_bound_s"] == pytest.approx(serial)
    assert report["decode_host_gap_by_batch"]["257-512"]["serial_frac"] == pytest.approx(0.5)


def test_roofline_report_fractions(llama8b) -> None:
    _, cost = llama8b
    hw = Hardware(bandwidth=4e12, matmul_flops=800e12)
    passes = [(1000, 2, 1000, 500_000), (2, 2, 1002, 1002), (2, 2, 1004, 1004)]
    bounds = [cost.pass_bound(hw, *p) for p in passes]
    steps = [2 * b for b in bounds]  # every step twice its bound
    report = roofline_report(cost, hw, passes, steps, wall_seconds=sum(steps))
    assert report["roofline_frac"] == pytest.approx(0.5)
    assert report["decode_passes"] == 2
    assert report["decode_roofline_frac"] == pytest.approx(0.5)
    assert report["mixed_passes"] == 1 and report["mixed_seconds"] == pytest.approx(steps[0])
    assert report["decode_seconds"] + report["mixed_seconds"] == pytest.approx(sum(steps))
    assert report["hbm_gb_s"] == pytest.approx(4000)


def test_roofline_report_splits_gpu_busy_from_host_wait(llama8b) -> None:
    _, cost = llama8b
    hw = Hardware(bandwidth=4e12, matmul_flops=800e12)
    passes = [(1000, 2, 1000, 500_000), (2, 2, 1002, 1002), (2, 2, 1004, 1004)]
    steps = [0.050, 0.010, 0.012]
    gpu = [0.040, 0.006, 0.007]
    report = roofline_report(cost, hw, passes, steps, wall_seconds=sum(steps), gpu_seconds=gpu)
    assert report["decode_gpu_ms"] == pytest.approx(6.5)
    assert report["decode_host_gap_ms"] == pytest.approx(4.5)
    assert report["decode_gpu_seconds"] == pytest.approx(0.013)
    assert report["mixed_host_gap_ms"] == pytest.approx(10.0)
    assert report["decode_host_gap_seconds"] == pytest.approx(0.009)
    assert report["decode_max_step_ms"] == pytest.approx(12.0)
    assert report["mixed_max_step_ms"] == pytest.approx(50.0)
    by_batch = report["decode_host_gap_by_batch"]
    assert list(by_batch) == ["1-64"]  # both decode passes have 2 sequences
    assert by_batch["1-64"]["passes"] == 2
    assert by_batch["1-64"]["host_gap_ms_mean"] == pytest.approx(4.5)
    assert by_batch["1-64"]["seconds"] == pytest.approx(0.022)
    bound = (cost.pass_bound(hw, *passes[1]) + cost.pass_bound(hw, *passes[2])) / 2
    assert by_batch["1-64"]["bound_ms_mean"] == pytest.approx(bound * 1e3)
    assert by_batch["1-64"]["roofline_frac"] == pytest.approx(2 * bound / 0.022)
    # The pass with prompt tokens and the one after it, as measured.
    assert report["mixed_pass_trace"] == [
        {"i": 0, "tokens": 1000, "seqs": 2, "step_ms": 50.0, "gpu_ms": 40.0},
        {"i": 1, "tokens": 2, "seqs": 2, "step_ms": 10.0, "gpu_ms": 6.0},
    ]
    # The device's own wait before each pass, when measured: summed by kind, traced per pass.
    waits = roofline_report(cost, hw, passes, steps, wall_seconds=sum(steps), gpu_seconds=gpu,
                            between_seconds=[0.0, 0.002, 0.0005])  # fmt: skip
    assert waits["mixed_device_wait_seconds"] == pytest.approx(0.0)
    assert waits["decode_device_wait_seconds"] == pytest.approx(0.0025)
    assert [r["wait_before_ms"] for r in waits["mixed_pass_trace"]] == [0.0, 2.0]
    assert "decode_device_wait_seconds" not in report  # not measured: not reported
    assert "wait_before_ms" not in report["mixed_pass_trace"][0]
    # Spans that do not line up with the passes (a CPU run has none) are ignored, not misread.
    short = roofline_report(cost, hw, passes, steps, wall_seconds=sum(steps), gpu_seconds=gpu[:2])
    assert "decode_gpu_ms" not in short
    assert "decode_host_gap_by_batch" not in short and "mixed_pass_trace" not in short
    mismatched = roofline_report(cost, hw, passes, steps, wall_seconds=sum(steps),
                                 gpu_seconds=gpu, between_seconds=[0.0])  # fmt: skip
    assert "decode_device_wait_seconds" not in mismatched


def test_the_better_of_two_hardware_measurements_counts() -> None:
    """A copy test that read low must not loosen the bound: each rate is the higher one."""
    low = Hardware(bandwidth=3.8e12, matmul_flops=800e12, fp8_matmul_flops=1.40e15)
    high = Hardware(bandwidth=4.25e12, matmul_flops=790e12, fp8_matmul_flops=None)
    best = low.best(high)
    assert (best.bandwidth, best.matmul_flops, best.fp8_matmul_flops) == (4.25e12, 800e12, 1.40e15)
    assert high.best(low) == best
    plain = Hardware(bandwidth=1.0, matmul_flops=2.0)
    assert plain.best(plain).fp8_matmul_flops is None


def _replay_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "roofline_replay.py"
    spec = importlib.util.spec_from_file_location("roofline_replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_replay_logs_passes_as_the_runner_does() -> None:
    """Two requests (prompts of 5 and 3 tokens, 4 and 2 tokens out): one pass with both
    prompts, then decodes of both, then two of the longer one alone. Each pass as
    (tokens, sequences, KV tokens attended, query-key pairs), counted by hand."""
    requests = [{"prompt_token_ids": [1, 2, 3, 4, 5], "output_len": 4},
                {"prompt_token_ids": [6, 7, 8], "output_len": 2}]  # fmt: skip
    passes = _replay_script().replay(requests, blocks=64, cpu_blocks=0, block_size=16,
                                     max_num_seqs=4, max_tokens=16, max_model_len=64)  # fmt: skip
    assert passes == [(8, 2, 8, 15 + 6), (2, 2, 10, 6 + 4), (1, 1, 7, 7), (1, 1, 8, 8)]


@pytest.mark.parametrize("fp8", [False, True])
def test_the_replay_recomputes_a_runs_bound(tmp_path, capsys, monkeypatch, llama8b, fp8) -> None:
    """A run's JSON and its requests: the replay prints the run's own overlapped bound (here
    made by the benchmark's costing of the same passes: bf16, or fp8 weights and cache at the
    fp8 rate) and the serial bound beside it."""
    import json

    from pagedkv.engine.model_loader import load_model
    from pagedkv.engine.models.quantization import quantize_model

    cfg, bf16_cost = llama8b
    script = _replay_script()
    requests = [{"prompt_token_ids": list(range(1, 40)), "output_len": 5},
                {"prompt_token_ids": list(range(1, 9)), "output_len": 3}]  # fmt: skip
    passes = script.replay(requests, blocks=64, cpu_blocks=0, block_size=16, max_num_seqs=4,
                           max_tokens=2048, max_model_len=2048)  # fmt: skip
    hw = Hardware(bandwidth=4e12, matmul_flops=800e12, fp8_matmul_flops=1600e12 if fp8 else None)
    cost = bf16_cost
    if fp8:
        model = load_model(cfg, load_format="dummy", device="meta")
        quantize_model(model, "fp8")
        cost = ModelCost.of(model, cfg, cfg.kv_bytes_per_token(torch.float8_e4m3fn))
    bound = sum(cost.pass_bound(hw, *p) for p in passes)
    serial = sum(cost.pass_serial_bound(hw, *p) for p in passes)
    run = {"num_prompts": 2, "num_gpu_blocks": 64, "max_num_seqs": 4, "forward_passes": len(passes),
           "roofline_bound_s": bound, "seconds": 2 * serial, "hbm_gb_s": 4000.0,
           "matmul_tflop_s": 800.0, "quantization": "fp8" if fp8 else "none",
           "kv_cache_dtype": "fp8" if fp8 else "auto", **hw.as_dict()}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "reqs.json").write_text(json.dumps({"requests": requests}))
    monkeypatch.setattr("sys.argv", ["roofline_replay.py", str(tmp_path / "run.json"), "--dataset",
                                     str(tmp_path / "reqs.json")])  # fmt: skip
    assert script.main() == 0
    out = capsys.readouterr().out
    assert f"overlapped bound: replay {bound:.3f} s, the run {bound:.3f} s" in out
    assert f"serial bound: {serial:.3f} s" in out and "50.0% of the serial one" in out


def test_nano_batches_read_the_weights_once_each(llama8b) -> None:
    """One nano-batch is the overlapped bound; each more adds a weight read. At 1,024
    sequences of 500 tokens two nano-batches beat the serial bound, at 64 they do not."""
    _, cost = llama8b
    script = _replay_script()
    hw = Hardware(bandwidth=4e12, matmul_flops=800e12)
    for b in (64, 1024):
        p = (b, b, b * 500, b * 500)
        assert script.nano_batch_bound(cost, hw, 1, p) == pytest.approx(cost.pass_bound(hw, *p))
        weights = cost.weight_bytes / 4e12
        two = script.nano_batch_bound(cost, hw, 2, p)
        assert two >= cost.pass_bound(hw, *p)
        if b == 64:  # memory-bound: the second weight read adds its whole time
            assert two == pytest.approx(cost.pass_bound(hw, *p) + weights)
            assert two > cost.pass_serial_bound(hw, *p)
        else:
            assert two < cost.pass_serial_bound(hw, *p)
