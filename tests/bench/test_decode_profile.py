"""The decode-step profile (`python -m pagedkv.bench.decode_step --profile-steps N`): GPU time
per step by kernel family, from a torch.profiler run's CUDA events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedkv.bench.decode_step import format_kernel_table, kernel_family, kernel_table


@pytest.mark.parametrize(("name", "family"), [
    ("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm"),
    ("paged_decode_attention_kernel", "attention"),
    ("_reshape_and_cache_kernel", "cache write"),
    ("fused_add_rms_norm_kernel", "rms norm"),
    ("_rotary_embedding_kernel", "rotary"),
    ("silu_and_mul_kernel", "silu and mul"),
    ("quantize_fp8_per_token_kernel", "fp8 quant"),
    ("void at::native::reduce_kernel<argmax>", "sampling"),
    ("void at::native::vectorized_elementwise_kernel<copy>", "other"),
])
def test_kernels_are_named_by_family(name: str, family: str) -> None:
    assert kernel_family(name) == family


def _event(name: str, us: float, device: bool = True) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_kernel_table_sums_gpu_time_per_step() -> None:
    events = [_event("nvjet_gemm", 100.0), _event("nvjet_gemm", 120.0),
              _event("paged_decode_attention", 30.0), _event("aten::mm", 999.0, device=False)]
    table = kernel_table(SimpleNamespace(events=lambda: events), steps=2)
    assert table["gpu_us_per_step"] == pytest.approx(125.0)  # host events are not GPU time
    assert table["families_us_per_step"] == pytest.approx({"gemm": 110.0, "attention": 15.0})
    top = table["top_kernels"][0]
    assert (top["name"], top["us_per_step"], top["calls_per_step"]) == ("nvjet_gemm", 110.0, 1.0)
    assert "gemm" in format_kernel_table(table)
    empty = kernel_table(SimpleNamespace(events=lambda: []), steps=1)
    assert format_kernel_table(empty) == "  (no GPU kernels traced)"


def test_timed_steps_are_decode_steps_after_chunked_prefills() -> None:
    """Prompts that take several chunked prefill passes and no warm-up steps: the timed
    window still holds only decode steps of the whole batch (it used to start as soon as the
    prompts were added, so at large batches it timed prefills)."""
    from pagedkv.bench import decode_step
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        device="cpu", kv_cache_gb=0.05, skip_tokenizer_init=True, max_num_batched_tokens=32,
        max_num_seqs=8,
    ))  # fmt: skip
    engine.emit_partial_outputs = False
    result = decode_step.measure_batch(engine, 4, 40, steps=3, warmup=0)
    assert result["decode_only"] and result["num_running"] == 4
    assert not engine.has_unfinished_requests()  # aborted at the end


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefill_passes_fill_the_token_budget(async_scheduling: bool) -> None:
    """`measure_prefill`: each timed pass is one step that prefills a whole token budget of
    fresh prompts, finished after it (with asynchronous scheduling, as on a GPU, the step
    that hands back their tokens comes later); the profile counts the attention kernels by
    name."""
    from pagedkv.bench import decode_step
    from pagedkv.engine.arg_utils import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        device="cpu", kv_cache_gb=0.05, skip_tokenizer_init=True, max_num_batched_tokens=64,
        max_num_seqs=8, async_scheduling=async_scheduling,
    ))  # fmt: skip
    engine.emit_partial_outputs = False
    result = decode_step.measure_prefill(engine, 20, passes=2, profile_passes=1)
    assert result["tokens_per_pass"] == 64 and result["passes"] == 2
    assert result["prefill_pass_ms"] > 0 and "kernels" in result
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="prefill-prompt-len"):
        decode_step.measure_prefill(engine, 0, passes=1)
    assert kernel_family("prefill_kernel") == "attention"
    assert kernel_family("decode_reduce_kernel") == "attention"
