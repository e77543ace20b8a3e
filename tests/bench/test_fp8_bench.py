"""The fp8 parts of pagedkv-bench: the accuracy measurement (its agreement figures on
hand-made token lists, then a small run end to end on the embedded model), the fp8 kernel rows
on the CPU, and the roofline's byte and FLOP counts of a model with fp8 weights."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.bench.fp8_accuracy import compare, main
from pagedkv.bench.instructions import ALPACA_LIKE_INSTRUCTIONS, alpaca_like_instructions

# --------------------------------------------------------------------------- agreement figures


def test_compare_counts_tokens_before_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]
    r = compare(ref, got)
    assert r["first_divergence"] == [4, 1, 0]
    assert r["agreement_before_divergence"] == pytest.approx(5 / 12)
    assert r["sequences_equal"] == pytest.approx(1 / 3)
    assert r["mean_first_divergence"] == pytest.approx(5 / 3)
    assert r["mean_first_divergence_of_diverged"] == pytest.approx(0.5)
    assert r["median_first_divergence"] == 1
    assert r["prefix_equal_at"] == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    # Token 2 of the second sequence is equal again after its divergence: counted here only.
    assert r["token_equal_at"] == pytest.approx([2 / 3, 2 / 3, 1.0, 1.0])
    same = compare(ref, ref)
    assert same["agreement_before_divergence"] == same["sequences_equal"] == 1.0
    assert same["mean_first_divergence_of_diverged"] is None


@pytest.mark.parametrize(
    "ref, got",
    [([], []), ([[1, 2]], []), ([[1, 2]], [[1]]), ([[1], [2, 3]], [[1], [2, 3]]), ([[]], [[]])],
)
def test_compare_refuses_unequal_shapes(ref, got):
    with pytest.raises(ValueError, match="compare needs"):
        compare(ref, got)


def test_instructions_are_64_distinct_and_bounded():
    assert len(set(ALPACA_LIKE_INSTRUCTIONS)) == len(ALPACA_LIKE_INSTRUCTIONS) == 64
    assert alpaca_like_instructions(3) == list(ALPACA_LIKE_INSTRUCTIONS[:3])
    for bad in (0, 65):
        with pytest.raises(ValueError, match="1 to 64"):
            alpaca_like_instructions(bad)


def test_accuracy_run_end_to_end(tmp_path, capsys):
    """Three prompts, six tokens, on the embedded model: the control agrees with the reference
    completely; the fp8 cache (e4m3 tensors) keeps the first token of every answer and, given
    the reference's history, its choices (the 64 x 64 run: 0.96); the prompts saved are read
    back the same, and the last line is the JSON written to the file."""
    prompts = tmp_path / "prompts.json"
    out = tmp_path / "acc.json"
    argv = ["--device", "cpu", "--num-prompts", "3", "--max-tokens", "6", "--kv-cache-gb", "0.02",
            "--swap-space", "0", "--variants", "control,kv_fp8", "--save-prompts", str(prompts),
            "--output-json", str(out), "--log-level", "WARNING"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    v = result["variants"]
    assert set(v) == {"control", "kv_fp8"}
    control, fp8 = v["control"], v["kv_fp8"]
    assert control["agreement_before_divergence"] == control["sequences_equal"] == 1.0
    assert control["teacher_forced_top1"] >= 0.8  # prefill and decode round differently
    assert fp8["kv_cache_dtype"] == "float8_e4m3fn" and control["kv_cache_dtype"] == "float32"
    assert min(fp8["first_divergence"]) >= 1, "the first token of every answer is kept"
    assert fp8["teacher_forced_top1"] >= 0.8
    assert all(x["preemptions"] == 0 for x in v.values())
    assert [row["position"] for row in result["prefix_equal_curve"]] == [1, 2, 4]
    saved = json.loads(prompts.read_text())
    assert len(saved["prompts"]) == 3 and "Alpaca-like" in saved["source"]
    assert result["commit"] and result["command"].startswith("python")
    # The same prompts from the file, on a machine without the tokenizer.
    argv2 = ["--device", "cpu", "--num-prompts", "3", "--max-tokens", "6", "--kv-cache-gb",
             "0.02", "--swap-space", "0", "--variants", "control", "--prompts-file",
             str(prompts), "--skip-tokenizer-init", "--log-level", "WARNING"]
    assert main(argv2) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["workload"].endswith(saved["source"])


def test_accuracy_run_refuses_bad_options_before_loading(capsys):
    assert main(["--variants", "fp9"]) == 2
    assert "unknown ['fp9']" in capsys.readouterr().err
    assert main(["--kv-cache-dtype", "fp8"]) == 2
    assert "leave --kv-cache-dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--kv-cache-dtype", "fp9"])


# --------------------------------------------------------------------------- kernel rows


def test_fp8_kernel_rows_on_the_cpu():
    from pagedkv.bench import kernels_fp8
    from pagedkv.bench.kernels import Setup

    setup = Setup(torch.device("cpu"), torch.float32, 4, 2, 64, 16, [2], [40], [48], True)
    gen = torch.Generator().manual_seed(0)
    decode = kernels_fp8.bench_decode_fp8(setup, 1e10, gen)
    assert [(r["batch"], r["context"]) for r in decode] == [(2, 40)]
    # The same values in both caches: only the order of float32 sums differs.
    assert decode[0]["rel_err_vs_16bit"] < 1e-5 and decode[0]["us"] > 0
    prefill = kernels_fp8.bench_prefill_fp8(setup, gen, [{"tokens": 48, "sdpa_us": 10.0}])
    assert prefill[0]["rel_err_vs_16bit"] < 1e-5 and prefill[0]["vs_sdpa"] > 0
    rows, layer = kernels_fp8.bench_gemm(setup, gen)
    assert {r["op"] for r in rows} == {"qkv", "o", "gate_up", "down"}
    assert all(r["path"] == "dequantizing fallback" for r in rows)
    # e4m3 on both operands: a few percent of the product.
    assert all(0 < r["rel_err_vs_16bit"] < 0.06 for r in rows)
    assert [t["m"] for t in layer] == [16, 64]
    heads = kernels_fp8.fp8_headlines(decode, prefill, layer)
    assert heads["gemm_fp8_vs_16bit_m512"] is None  # not measured at M = 512 on the CPU


def test_gemm_only_runs_just_the_gemm_and_quant_rows(capsys):
    """``--gemm-only`` (``scripts/gpu_fp8.sh gemm``): the GEMM rows and the quantizer rows
    (empty on the CPU: the Triton kernels are not timed in the interpreter), no attention."""
    from pagedkv.bench.kernels import main

    out = main(["--quick", "--gemm-only"])
    assert out["decode"] == out["prefill"] == out["fused"] == []
    assert out["decode_fp8"] == out["prefill_fp8"] == [] and out["quant"] == []
    assert [r["m"] for r in out["gemm_layer"]] == [16, 64]
    assert [r["m"] for r in out["gemm_layer_fused"]] == [16, 64]
    assert "quant_tiled_vs_per_row_m512_c14336" in out and "silu_fp8_tiled_vs_per_row_m512" in out
    assert "quant: the Triton kernels need a GPU" in capsys.readouterr().out


# --------------------------------------------------------------------------- roofline


def test_roofline_counts_fp8_weights_and_cache_at_their_size():
    from pagedkv.bench.roofline import Hardware, ModelCost
    from pagedkv.engine.config import ModelConfig
    from pagedkv.engine.model_loader import load_model

    cfg = ModelConfig.from_model("meta-llama/Meta-Llama-3-8B", load_format="dummy",
                                 dtype="bfloat16", device="cpu")
    model = load_model(cfg, load_format="dummy", device="meta", quantization="fp8")
    cost = ModelCost.of(model, cfg, cfg.kv_bytes_per_token(torch.float8_e4m3fn))
    embed = lm_head = 128256 * 4096
    norms = 32 * 2 * 4096 + 4096
    linear = 8_030_261_248 - embed - lm_head - norms
    assert cost.weight_bytes == linear * 1 + (norms + lm_head) * 2
    assert cost.fp8_params == linear and cost.matmul_params == linear + norms
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128  # one byte per K/V element
    hw = Hardware(bandwidth=4e12, matmul_flops=800e12, fp8_matmul_flops=1600e12)
    pairs = 4096 * 4097 // 2
    prefill = cost.pass_bound(hw, 4096, 1, 4096, pairs)
    want = ((2 * norms * 4096 + 2 * lm_head + cost.attn_flops_per_pair * pairs) / 800e12
            + 2 * linear * 4096 / 1600e12)
    assert prefill == pytest.approx(want)
    assert hw.as_dict()["fp8_matmul_tflop_s"] == pytest.approx(1600)
