"""``fp8_matmul_silu_and_mul`` and ``matmul_16bit_silu_and_mul``: a fused gate/up projection and
SwiGLU's activation in one kernel.

- on every backend, bit for bit the two ops they replace run one after the other (the matmul
  with the same tiles, then ``silu_and_mul``; with ``fp8_out``, ``silu_and_mul_fp8``), at
  gate/up-shaped sizes off every tile, and close to the float64 reference;
- the kernel's tiles are the plain matmul's for the shape, never split;
- replayed in a CUDA graph, the same bits (GPU);
- bad calls: a clear ``ValueError``; empty batches give empty outputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference

FP8, F32, BF16, F16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.float16

# (M, I, K): the projection is [M, 2 I]; one token, a few, a 16-token tile exactly, past it,
# past 64 and past 128 (two token tiles); I off the interpreter's 16-product tiles
SHAPES = [(1, 48, 96), (3, 40, 200), (16, 64, 192), (21, 100, 136), (70, 24, 64), (150, 40, 96)]
# Llama-3-8B's gate/up (I = 14,336, K = 4,096) at decode sizes, and an odd one
FULL_SHAPES = [(1, 14336, 4096), (16, 14336, 4096), (37, 14336, 4096), (128, 14336, 4096),
               (7, 1000, 1000)]  # fmt: skip


def _operands(gen: torch.Generator, m: int, inter: int, k: int, device: str):
    x = torch.randn(m, k, generator=gen, device=device)
    x = x * torch.exp(torch.randn(m, 1, generator=gen, device=device))
    # channels of different scales; products small enough that silu(gate) * up stays
    # finite in float16 (65,504) at K = 4,096
    w = torch.randn(2 * inter, k, generator=gen, device=device) * k**-0.5
    w[::7] *= 4.0
    xq, xs = pk.quantize_fp8_per_token(x, backend="torch")
    wq, ws = pk.quantize_fp8_per_token(w, backend="torch")
    return x, w, xq, xs, wq, ws.reshape(1, -1)


def _unsplit_config(target, m: int, n: int, k: int, scaled: bool, fast_accum: bool):
    """The tiles the fused kernel takes for this shape (the plain matmul's, unsplit), for the
    plain matmul to sum in the same order; None on the torch path."""
    if target.backend != "triton":
        return None
    from pagedattn_kernels.quant import triton_launch as ql

    cfg = ql._config(m, n, k, torch.device(target.device), scaled, None, fast_accum)
    return dataclasses.replace(cfg, split_k=1)


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_fp8_equals_the_matmul_then_silu_and_mul(target, seed, dtype):
    gen = target.generator(seed)
    fast = target.full  # the engine's fast accumulation (the same exact sums off the GPU)
    for m, inter, k in FULL_SHAPES if target.full else SHAPES:
        _, _, xq, xs, wq, ws = _operands(gen, m, inter, k, target.device)
        cfg = _unsplit_config(target, m, 2 * inter, k, True, fast)
        y = pk.fp8_matmul(xq, xs, wq, ws, out_dtype=dtype, config=cfg, fast_accum=fast,
                          backend=target.backend)  # fmt: skip
        want = pk.silu_and_mul(y, backend=target.backend)
        got = pk.fp8_matmul_silu_and_mul(xq, xs, wq, ws, out_dtype=dtype, fast_accum=fast,
                                         backend=target.backend)  # fmt: skip
        where = f"M={m} I={inter} K={k} (seed={seed})"
        assert got.shape == (m, inter) and got.dtype == dtype, where
        assert torch.equal(got, want), where
        if cfg is not None:  # the default tiles are these
            same = pk.fp8_matmul_silu_and_mul(xq, xs, wq, ws, out_dtype=dtype, config=cfg,
                                              fast_accum=fast, backend="triton")  # fmt: skip
            assert torch.equal(same, got), where
        ref = reference.fp8_matmul_silu_and_mul(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu())
        err = float((got.cpu().double() - ref).norm() / ref.norm())
        assert err < 3e-2, f"{where}: relative error {err:.1e}"  # 16-bit roundings, fast sums
        q_want, s_want = pk.silu_and_mul_fp8(y, backend=target.backend)
        q, s = pk.fp8_matmul_silu_and_mul(xq, xs, wq, ws, out_dtype=dtype, fp8_out=True,
                                          fast_accum=fast, backend=target.backend)  # fmt: skip
        assert q.dtype == FP8 and q.shape == (m, inter) and s.shape == (m, 1), where
        assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)), where
        assert torch.equal(s, s_want), where


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_16bit_equals_the_matmul_then_silu_and_mul(target, seed, dtype):
    gen = target.generator(seed)
    for m, inter, k in FULL_SHAPES if target.full else SHAPES:
        _, w, *_ = _operands(gen, m, inter, k, target.device)
        # rows of one scale: the activation of float16 products stays finite
        x = torch.randn(m, k, generator=gen, device=target.device).to(dtype)
        w = w.to(dtype)
        cfg = _unsplit_config(target, m, 2 * inter, k, False, False)
        want = pk.silu_and_mul(pk.matmul_16bit(x, w, config=cfg, backend=target.backend),
                               backend=target.backend)  # fmt: skip
        got = pk.matmul_16bit_silu_and_mul(x, w, backend=target.backend)
        where = f"M={m} I={inter} K={k} (seed={seed})"
        assert got.shape == (m, inter) and got.dtype == dtype, where
        assert torch.equal(got, want), where
        ref = reference.matmul_16bit_silu_and_mul(x.cpu(), w.cpu())
        err = float((got.cpu().double() - ref).norm() / ref.norm())
        assert err < 3e-2, f"{where}: relative error {err:.1e}"  # 16-bit roundings, fast sums


@pytest.mark.gpu
def test_replays_in_a_cuda_graph(seed):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    _, w, xq, xs, wq, ws = _operands(gen, 16, 14336, 4096, "cuda")
    x16, w16 = torch.randn(16, 4096, device="cuda", generator=gen).to(BF16), w.to(BF16)
    eager = (pk.fp8_matmul_silu_and_mul(xq, xs, wq, ws, fp8_out=True, fast_accum=True),
             pk.matmul_16bit_silu_and_mul(x16, w16))  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (q, s), a = (pk.fp8_matmul_silu_and_mul(xq, xs, wq, ws, fp8_out=True, fast_accum=True),
                     pk.matmul_16bit_silu_and_mul(x16, w16))  # fmt: skip
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q.view(torch.uint8), eager[0][0].view(torch.uint8))
    assert torch.equal(s, eager[0][1]) and torch.equal(a, eager[1])


def test_empty_batches():
    wq = torch.zeros(64, 32, dtype=FP8)
    for backend in ("torch", "triton"):
        a = pk.fp8_matmul_silu_and_mul(torch.zeros(0, 32, dtype=FP8), torch.ones(0, 1), wq,
                                       torch.ones(1, 64), backend=backend)  # fmt: skip
        assert a.shape == (0, 32)
        q, s = pk.fp8_matmul_silu_and_mul(torch.zeros(0, 32, dtype=FP8), torch.ones(0, 1), wq,
                                          torch.ones(1, 64), fp8_out=True,
                                          backend=backend)  # fmt: skip
        assert q.shape == (0, 32) and s.shape == (0, 1)
        w16 = torch.zeros(64, 32, dtype=BF16)
        assert pk.matmul_16bit_silu_and_mul(torch.zeros(0, 32, dtype=BF16), w16,
                                            backend=backend).shape == (0, 32)  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_calls_are_rejected(backend):
    xq, xs = torch.zeros(4, 64, dtype=FP8), torch.ones(4, 1)
    wq, ws = torch.zeros(32, 64, dtype=FP8), torch.ones(1, 32)
    with pytest.raises(ValueError, match="fp8_matmul_silu_and_mul: the weight must stack"):
        pk.fp8_matmul_silu_and_mul(xq, xs, wq[:31], ws[:, :31], backend=backend)
    with pytest.raises(ValueError, match=r"fp8_matmul_silu_and_mul: .*share the inner"):
        pk.fp8_matmul_silu_and_mul(xq, xs, wq[:, :48], ws, backend=backend)
    with pytest.raises(ValueError, match="fp8_matmul_silu_and_mul: x_scale must hold"):
        pk.fp8_matmul_silu_and_mul(xq, xs[:3], wq, ws, backend=backend)
    x, w = torch.zeros(4, 64, dtype=BF16), torch.zeros(32, 64, dtype=BF16)
    with pytest.raises(ValueError, match="matmul_16bit_silu_and_mul: the weight must stack"):
        pk.matmul_16bit_silu_and_mul(x, w[:31], backend=backend)
    with pytest.raises(ValueError, match="matmul_16bit_silu_and_mul: w must be one of"):
        pk.matmul_16bit_silu_and_mul(x, w.to(F16), backend=backend)
