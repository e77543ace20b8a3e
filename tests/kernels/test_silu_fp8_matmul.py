"""``silu_and_mul_fp8_matmul``: SwiGLU's activation quantized per token and multiplied by an
e4m3 weight, the quantization done as the matmul loads its rows (Triton) — against its
contract, the two ops in turn on the same backend, bit for bit:

- rows of very different magnitudes, an all-zero row (the smallest scale) and one small enough
  for subnormal e4m3 codes; one row, a few, a full tile and more; widths off the tiles;
- the split-K tiles, both merges (the last split's and the reduce kernel's): the scales the
  matmul writes reach the reduce kernel;
- the torch path is the composition of the torch paths, and close to the float64 reference;
- bad calls: a clear ``ValueError`` and nothing written.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference

FP8, F32, BF16, F16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.float16


def _inputs(gen: torch.Generator, rows: int, inter: int, n: int, device: str,
            dtype: torch.dtype = BF16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(gate, up) rows of magnitudes e^N(0, 1), the first all zero and the second tiny; an
    e4m3 weight with channels of different scales."""
    x = torch.randn(rows, 2 * inter, generator=gen, device=device)
    x = x * torch.exp(torch.randn(rows, 1, generator=gen, device=device))
    if rows > 2:
        x[0] = 0.0
        x[1] *= 1e-4
    w = torch.randn(n, inter, generator=gen, device=device) * inter**-0.5
    w[::7] *= 30.0
    wq, ws = pk.quantize_fp8_per_token(w, backend="torch")
    return x.to(dtype), wq, ws.reshape(1, -1)


def _composition(x, wq, ws, backend, **kw):
    q, s = pk.silu_and_mul_fp8(x, backend=backend)
    return pk.fp8_matmul(q, s, wq, ws, out_dtype=kw.pop("out_dtype", x.dtype), backend=backend,
                         **kw)  # fmt: skip


CPU_SHAPES = [(1, 64, 48), (5, 100, 40), (40, 96, 80), (128, 64, 32)]
GPU_SHAPES = [(1, 14336, 4096), (16, 14336, 4096), (64, 14336, 4096), (128, 14336, 4096)]


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_is_the_two_ops_in_turn_bit_for_bit(target, seed, dtype):
    gen = target.generator(seed)
    for rows, inter, n in GPU_SHAPES if target.full else CPU_SHAPES:
        x, wq, ws = _inputs(gen, rows, inter, n, target.device, dtype)
        got = pk.silu_and_mul_fp8_matmul(x, wq, ws, backend=target.backend)
        want = _composition(x, wq, ws, target.backend)
        assert got.shape == (rows, n) and got.dtype == dtype
        assert torch.equal(got, want), f"rows={rows} I={inter} N={n} (seed={seed})"
        fast = pk.silu_and_mul_fp8_matmul(x, wq, ws, fast_accum=True, backend=target.backend)
        assert torch.equal(fast, _composition(x, wq, ws, target.backend, fast_accum=True))


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_and_both_merges(target, seed, split_k):
    """Split K: the last split merges (the scales in its registers) or the reduce kernel does
    (the scales the first programs stored); either way the composition's bits, into a given
    output with strided rows."""
    if target.backend != "triton":
        pytest.skip("a Triton kernel option")
    from pagedattn_kernels.quant import triton_launch as ql

    gen = target.generator(seed)
    rows, inter, n = (40, 200, 48) if not target.full else (64, 14336, 4096)
    x, wq, ws = _inputs(gen, rows, inter, n, target.device)
    cfg = ql.Fp8MatmulConfig(block_n=32 if not target.full else 64, block_k=64 if not
                             target.full else 256, split_k=split_k,
                             num_stages=1 if not target.full else 4)  # fmt: skip
    want = _composition(x, wq, ws, "triton", config=cfg)
    for merge_here in (True, False):
        wide = torch.full((rows, n + 8), float("nan"), dtype=BF16, device=target.device)
        got = pk.silu_and_mul_fp8_matmul(x, wq, ws, out=wide[:, :n], backend="triton",
                                         config=dataclasses.replace(cfg, merge_here=merge_here))
        assert got.data_ptr() == wide.data_ptr() and torch.isnan(wide[:, n:]).all()
        assert torch.equal(got, want), f"merge_here={merge_here} (seed={seed})"
    assert not ql._COUNTERS[x.device].any()


def test_torch_path_and_the_reference(seed):
    """The torch path is the torch ops in turn, exactly, and within the fp8 quantization's own
    error of the float64 reference (whose SiLU rounds once, from float64: a product on a
    rounding boundary can land one e4m3 step away)."""
    gen = torch.Generator().manual_seed(seed)
    x, wq, ws = _inputs(gen, 24, 96, 40, "cpu")
    got = pk.silu_and_mul_fp8_matmul(x, wq, ws, out_dtype=F32, backend="torch")
    assert torch.equal(got, _composition(x, wq, ws, "torch", out_dtype=F32))
    ref = reference.silu_and_mul_fp8_matmul(x, wq, ws)
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < 1e-2, f"relative error {err:.2e} (seed={seed})"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_calls_change_nothing(backend):
    x = torch.randn(4, 64, dtype=BF16)
    wq = torch.zeros(16, 32, dtype=FP8)
    ws = torch.ones(1, 16)
    out = torch.full((4, 16), 7.0, dtype=BF16)
    bad = [
        (dict(x=x[:, :63]), "2 \\* intermediate"),
        (dict(wq=torch.zeros(16, 31, dtype=FP8)), "wq must be \\[out, 32\\]"),
        (dict(wq=torch.zeros(16, 32, dtype=BF16)), "wq must be one of"),
        (dict(w_scale=torch.ones(15)), "one float32 scale per row"),
        (dict(out=torch.empty(4, 15, dtype=BF16)), "shape \\(4, 16\\)"),
        (dict(out_dtype=torch.int32), "out_dtype"),
        (dict(x=x.reshape(2, 2, 64)), "\\[rows, 2 \\* intermediate\\]"),
    ]
    for change, match in bad:
        args = dict(x=x, wq=wq, w_scale=ws, out=out)
        args.update(change)
        kw = {k: args.pop(k) for k in ("out", "out_dtype") if k in args}
        if "out_dtype" in kw:
            kw.pop("out", None)
        with pytest.raises(ValueError, match=match):
            pk.silu_and_mul_fp8_matmul(args["x"], args["wq"], args["w_scale"], backend=backend,
                                       **kw)  # fmt: skip
        assert (out == 7.0).all(), f"{change}: out was written"
    if backend == "triton":
        with pytest.raises(ValueError, match="up to 128 rows"):
            pk.silu_and_mul_fp8_matmul(torch.zeros(129, 64, dtype=BF16), wq, ws, backend=backend)
