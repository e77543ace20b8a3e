"""SwiGLU's gate/up projection and activation in one kernel (``layers.gate_up_silu_and_mul``).

Decode batches of 16-bit weights on a Hopper GPU send the gate/up matmul to ``matmul_16bit``;
there the activation is made in the matmul's epilogue. Here the CPU is let in
(``takes_matmul_16bit``, ``FP8_MATMUL_DEVICES``) and the kernels run in Triton's interpreter:
a Llama MLP gives the same bits with the fused kernel as with the two ops
(``PAGEDKV_FUSED_GATE_UP_SILU=0``'s path); more rows than the matmul kernel takes, fp8
weights, a bias, or the torch backend keep the two ops.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import pagedattn_kernels
from pagedkv.engine.models import dense_linear, layers, quantization
from pagedkv.engine.models.llama import LlamaMLP
from pagedkv.engine.models.quantization import Fp8Rows, quantize_model

CFG = SimpleNamespace(hidden_size=64, intermediate_size=80, hidden_act="silu", mlp_bias=False)


def _mlp(gen: torch.Generator, dtype: torch.dtype, fp8: bool) -> LlamaMLP:
    mlp = LlamaMLP(CFG)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    mlp = mlp.to(dtype)
    if fp8:
        quantize_model(mlp, "fp8")
        mlp.fp8_act = True  # what LlamaDecoderLayer.use_fp8_inputs sets
    return mlp


@pytest.fixture
def fused_calls(monkeypatch):
    """The Triton kernels in the interpreter on the CPU, the CPU let into the streaming
    matmuls; returns the list of row counts the fused op was called with."""
    monkeypatch.setenv("PAGEDATTN_BACKEND", "triton")
    monkeypatch.setattr(quantization, "FP8_MATMUL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(dense_linear, "takes_matmul_16bit",
                        lambda x, w: x.dtype == w.dtype == torch.bfloat16
                        and x.numel() // x.shape[-1] <= 8)  # fmt: skip
    calls: list[int] = []
    for name in ("fp8_matmul_silu_and_mul", "matmul_16bit_silu_and_mul"):
        real = getattr(pagedattn_kernels, name)
        monkeypatch.setattr(pagedattn_kernels, name,
                            lambda *a, _real=real, **k: calls.append(a[0].shape[0])
                            or _real(*a, **k))  # fmt: skip
    return calls


def _both_ways(mlp: LlamaMLP, x, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    monkeypatch.setattr(layers, "_FUSE_GATE_UP_SILU", False)
    apart = mlp(x)
    monkeypatch.setattr(layers, "_FUSE_GATE_UP_SILU", True)
    return mlp(x), apart


def test_16bit_mlp_same_bits_fused(seed, fused_calls, monkeypatch):
    gen = torch.Generator().manual_seed(seed)
    mlp = _mlp(gen, torch.bfloat16, fp8=False)
    x = torch.randn(5, CFG.hidden_size, generator=gen).to(torch.bfloat16)
    fused, apart = _both_ways(mlp, x, monkeypatch)
    assert fused_calls == [5] and torch.equal(fused, apart), f"seed={seed}"
    big = torch.randn(9, CFG.hidden_size, generator=gen).to(torch.bfloat16)
    fused, apart = _both_ways(mlp, big, monkeypatch)
    assert fused_calls == [5] and torch.equal(fused, apart)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_keep_the_two_ops(seed, dtype, fused_calls, monkeypatch):
    """fp8 weights: the matmul, then the activation quantizing for the down projection (the
    fused op measured slower at 8-32 rows on an H200), from plain or pre-quantized rows."""
    gen = torch.Generator().manual_seed(seed)
    mlp = _mlp(gen, dtype, fp8=True)
    x = (torch.randn(2, 3, CFG.hidden_size, generator=gen) * 2).to(dtype)
    fused, apart = _both_ways(mlp, x, monkeypatch)
    assert fused.shape == x.shape and torch.equal(fused, apart), f"seed={seed}"
    q, scale = pagedattn_kernels.quantize_fp8_per_token(x.reshape(-1, CFG.hidden_size))
    rows = Fp8Rows(q.reshape(2, 3, -1), scale.reshape(2, 3, 1), dtype)
    fused, apart = _both_ways(mlp, rows, monkeypatch)
    assert torch.equal(fused, apart) and fused_calls == []


def test_two_ops_where_the_kernel_does_not_apply(seed, fused_calls, monkeypatch):
    """A bias, or the torch backend (the CPU's default path), keeps the matmul and the
    activation apart."""
    gen = torch.Generator().manual_seed(seed)
    mlp = LlamaMLP(SimpleNamespace(**{**vars(CFG), "mlp_bias": True}))
    x = torch.randn(3, CFG.hidden_size, generator=gen)
    fused, apart = _both_ways(mlp, x, monkeypatch)
    assert torch.equal(fused, apart)
    monkeypatch.setenv("PAGEDATTN_BACKEND", "torch")
    fused, apart = _both_ways(_mlp(gen, torch.float32, fp8=True), x, monkeypatch)
    assert torch.equal(fused, apart)
    assert fused_calls == []
