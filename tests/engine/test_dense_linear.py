"""``dense_linear``: the unquantized linear layers' matmul, ``F.linear`` or, for bf16 and fp16
decode batches on a Hopper GPU, ``pagedattn_kernels.matmul_16bit``.

- CPU: always ``F.linear`` (the same bits), whatever the rows;
- GPU (``gpu``): 1-32 rows of bf16 and fp16 go to the kernel, with and without a bias and
  through leading dims, within two roundings of the output of ``F.linear``; more rows, float32,
  mixed dtypes and the limit 0 (``PAGEDKV_MATMUL_16BIT_MAX_ROWS``) keep ``F.linear``; a bf16
  engine whose decode graphs run the kernel generates the tokens that the cuBLAS engine ranks
  first.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedattn_kernels
from pagedkv.engine.models import dense_linear as dl

from .test_fp8 import PROMPTS, _gpu_engine, run_all, teacher_forced_top1


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """The row counts of ``pagedattn_kernels.matmul_16bit``'s calls."""
    calls: list[int] = []
    real = pagedattn_kernels.matmul_16bit
    monkeypatch.setattr(pagedattn_kernels, "matmul_16bit",
                        lambda x, w, **k: calls.append(x.shape[0]) or real(x, w, **k))  # fmt: skip
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_keeps_f_linear(seed, dtype, kernel_calls):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 40, generator=gen).to(dtype)
    b = torch.randn(24, generator=gen).to(dtype)
    for rows in (1, 16, 32, 33):
        x = torch.randn(rows, 40, generator=gen).to(dtype)
        assert torch.equal(dl.dense_linear(x, w, b), F.linear(x, w, b))
        assert not dl.takes_matmul_16bit(x, w)
    assert kernel_calls == []
    assert dl.MATMUL_16BIT_MAX_ROWS == 32  # the default


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_decode_rows_take_the_kernel(seed, dtype, kernel_calls, monkeypatch):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the kernel is taken on Hopper only")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, k = 6144, 4096
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    for shape in ((1, k), (16, k), (32, k), (2, 8, k)):
        x = torch.randn(*shape, generator=gen, device="cuda").to(dtype)
        product = F.linear(x.double(), w.double())
        sums = (k + 1) * 2.0**-24 * F.linear(x.double().abs(), w.double().abs())
        for b in (None, bias):
            y, ref = dl.dense_linear(x, w, b), F.linear(x, w, b)
            assert y.shape == ref.shape and y.dtype == dtype
            exact = product if b is None else product + b.double()
            # float32 sums, then at most two roundings: the product's and the bias add's
            bound = u * (product.abs() + exact.abs()) * (1 + u) + sums
            err = float(((y.double() - exact).abs() / bound).max())
            assert err <= 1.0, f"{shape} bias={b is not None}: {err:.2f} (seed={seed})"
    assert kernel_calls == [1, 1, 16, 16, 32, 32, 16, 16]
    kernel_calls.clear()
    x33 = torch.randn(33, k, device="cuda", dtype=dtype)
    dl.dense_linear(x33, w)
    dl.dense_linear(torch.randn(4, k, device="cuda"), w.float())
    assert not dl.takes_matmul_16bit(x33[:4], w.float())  # mixed dtypes: F.linear's error
    monkeypatch.setattr(dl, "MATMUL_16BIT_MAX_ROWS", 0)
    dl.dense_linear(x33[:4], w)
    assert kernel_calls == []


@pytest.mark.gpu
def test_gpu_engine_with_the_kernel_agrees_with_cublas(gpu_model_path, kernel_calls, monkeypatch):
    """bf16 decode through CUDA graphs that run ``matmul_16bit`` (captured at 1-32 rows):
    the tokens it generates are the cuBLAS engine's first choice, given their history."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the kernel is taken on Hopper only")
    engine = _gpu_engine(gpu_model_path)
    got = run_all(engine, PROMPTS)
    assert engine.runner.graph_replays > 0 and kernel_calls, "the decode graphs ran the kernel"
    del engine
    torch.cuda.empty_cache()
    monkeypatch.setattr(dl, "MATMUL_16BIT_MAX_ROWS", 0)
    kernel_calls.clear()
    cublas = _gpu_engine(gpu_model_path)
    top1 = teacher_forced_top1(cublas, PROMPTS, got)
    assert kernel_calls == []
    assert top1 >= 0.95, f"teacher-forced top-1 {top1:.3f}"
