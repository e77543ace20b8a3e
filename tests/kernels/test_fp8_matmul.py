"""``fp8_matmul``: e4m3 rows times an e4m3 weight, against the float64 reference; and
``matmul_16bit``, its kernel on bf16 and fp16 operands.

- every backend (the torch path, the Triton kernel in the interpreter and compiled) within an
  elementwise bound of the float64 product of the dequantized operands: the output's rounding
  plus the float32 sums' (``_bound``), at decode-sized and larger M, N and K off the tiles,
  with and without split-K;
- the split sums are added in a fixed order: the same bits on every call;
- bad calls: a clear ``ValueError`` and nothing written.
"""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference

FP8, F32, BF16, F16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.float16


def _operands(gen: torch.Generator, m: int, n: int, k: int, device: str):
    """Rows of different magnitudes and a weight whose channels differ in scale, quantized
    as the engine quantizes them."""
    x = torch.randn(m, k, generator=gen, device=device)
    # (row scales e^N(0,1): the products stay far inside float16's range, 65,504)
    x = x * torch.exp(torch.randn(m, 1, generator=gen, device=device))
    w = torch.randn(n, k, generator=gen, device=device) * k**-0.5
    w[::7] *= 30.0
    xq, xs = pk.quantize_fp8_per_token(x, backend="torch")
    wq, ws = pk.quantize_fp8_per_token(w, backend="torch")
    return xq, xs, wq, ws.reshape(1, -1)  # the weight scale as quantize_weight keeps it


def _bound(xq, xs, wq, ws, dtype: torch.dtype, interpreted: bool) -> torch.Tensor:
    """|y - ref| <= u |ref| + (1 + u) (K + 3) 2^-24 (|x| @ |w|.T): u the output dtype's
    rounding (bf16 in the interpreter truncates: 2^-7), then the float32 sums of K exact
    products and the two scalings, in any order."""
    u = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-7 if interpreted else 2.0**-8}[dtype]
    x = xq.double().abs() * xs.double().reshape(-1, 1)
    w = wq.double().abs() * ws.double().reshape(-1, 1)
    ref = reference.fp8_matmul(xq, xs, wq, ws)
    k = xq.shape[1]
    return ref, u * ref.abs() + (1 + u) * (k + 3) * 2.0**-24 * (x @ w.T)


# (M, N, K): one token, a few, a 16-token block exactly, past it, past 64, past 128 (two M
# blocks of 128); N and K off every tile
SHAPES = [(1, 96, 256), (3, 80, 200), (16, 64, 192), (21, 48, 136), (70, 40, 96),
          (150, 40, 96)]
FULL_SHAPES = [(1, 4096, 4096), (16, 6144, 4096), (37, 4096, 14336), (64, 28672, 4096),
               (200, 1000, 1000)]  # fmt: skip


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_fp8_matmul_within_bound(target, seed, dtype):
    gen = target.generator(seed)
    interpreted = target.backend == "triton" and not target.full
    for m, n, k in FULL_SHAPES if target.full else SHAPES:
        xq, xs, wq, ws = _operands(gen, m, n, k, target.device)
        y = pk.fp8_matmul(xq, xs, wq, ws, out_dtype=dtype, backend=target.backend)
        assert y.shape == (m, n) and y.dtype == dtype
        ref, bound = _bound(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), dtype, interpreted)
        worst = float(((y.cpu().double() - ref).abs() / bound).max())
        assert worst <= 1.0, f"M={m} N={n} K={k}: |err| / bound {worst:.2f} (seed={seed})"


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_fp8_matmul_split_k(target, seed, split_k):
    """Split-K (the partial sums of K ranges, added in split order and scaled by the tile's
    last split, ``merge_here``, or by a second kernel): within the bound, an empty last split
    included (K = 200 in steps of 64: splits of 2, 2, 0), into a given output with strided
    rows, over two blocks of tokens (a merge count per (M block, N block)); the same bits on
    a second call and from both merges; the merge's counts left at zero for the next call."""
    if target.backend != "triton":
        pytest.skip("a Triton kernel option")
    from pagedattn_kernels.quant import triton_launch as ql

    gen = target.generator(seed)
    m, n, k = (150, 80, 200) if not target.full else (200, 4096, 14336)
    cfg = ql.Fp8MatmulConfig(block_n=32 if not target.full else 128, block_k=64,
                             split_k=split_k, num_stages=1 if not target.full else 4)  # fmt: skip
    xq, xs, wq, ws = _operands(gen, m, n, k, target.device)
    wide = torch.full((m, n + 8), float("nan"), dtype=BF16, device=target.device)
    out = wide[:, :n]
    y = pk.fp8_matmul(xq, xs, wq, ws, out=out, config=cfg, backend="triton")
    assert y is out and torch.isnan(wide[:, n:]).all()
    ref, bound = _bound(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), BF16, not target.full)
    worst = float(((y.cpu().double() - ref).abs() / bound).max())
    assert worst <= 1.0, f"split {split_k}: |err| / bound {worst:.2f} (seed={seed})"
    again = pk.fp8_matmul(xq, xs, wq, ws, config=cfg, backend="triton")
    assert torch.equal(again, y), f"seed={seed}"
    other = ql.Fp8MatmulConfig(cfg.block_n, cfg.block_k, split_k, cfg.num_warps, cfg.num_stages,
                               merge_here=False)  # fmt: skip
    assert torch.equal(pk.fp8_matmul(xq, xs, wq, ws, config=other, backend="triton"), y)
    if split_k > 1:
        assert not ql._COUNTERS[xq.device].any()


def test_fp8_matmul_fast_accumulation(target, seed):
    """``fast_accum=True``: on a GPU the fp8 tensor cores sum without promoting each K block to
    float32 (as ``torch._scaled_mm(use_fast_accum=True)``), so the exact bound above does not
    hold, but the result stays within 1e-2 (relative, Frobenius) of the float64 product at
    Llama-3-8B's shapes; elsewhere (the torch path, the interpreter) it is the exact sum,
    bit for bit the default's."""
    gen = target.generator(seed)
    for m, n, k in FULL_SHAPES if target.full else SHAPES:
        xq, xs, wq, ws = _operands(gen, m, n, k, target.device)
        y = pk.fp8_matmul(xq, xs, wq, ws, fast_accum=True, backend=target.backend)
        exact = pk.fp8_matmul(xq, xs, wq, ws, backend=target.backend)
        if not target.full:
            assert torch.equal(y, exact), f"M={m} N={n} K={k} (seed={seed})"
            continue
        ref = reference.fp8_matmul(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu())
        err = float((y.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-2, f"M={m} N={n} K={k}: rel error {err:.1e} (seed={seed})"


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("split_k", [0, 1, 3])
def test_matmul_16bit_within_bound(target, seed, dtype, split_k):
    """``matmul_16bit``, the same kernel on 16-bit operands without scales (the engine's bf16
    decode batches): ``x @ w.T`` within the output's rounding plus float32 sums of K exact
    products of the float64 reference, at the shapes above, on every backend; on Triton split K
    merged by the last split and by the second kernel alike (the same bits), the pick for each
    shape (split 0: ``pick_config_16bit``, or the interpreter's tiles) and forced splits."""
    if target.backend != "triton" and split_k:
        pytest.skip("a Triton kernel option")
    from pagedattn_kernels.quant import triton_launch as ql

    gen = target.generator(seed)
    for m, n, k in FULL_SHAPES if target.full else SHAPES:
        x = torch.randn(m, k, generator=gen, device=target.device).to(dtype)
        w = (torch.randn(n, k, generator=gen, device=target.device) * k**-0.5).to(dtype)
        cfg = None if split_k == 0 else ql.Fp8MatmulConfig(
            block_n=32 if not target.full else 64, block_k=32 if not target.full else 128,
            split_k=split_k, num_stages=1 if not target.full else 4)  # fmt: skip
        out = torch.full((m, n), float("nan"), dtype=dtype, device=target.device)
        y = pk.matmul_16bit(x, w, out=out, config=cfg, backend=target.backend)
        assert y is out
        ref = reference.matmul_16bit(x.cpu(), w.cpu())
        interpreted = target.backend == "triton" and not target.full
        u = {F16: 2.0**-11, BF16: 2.0**-7 if interpreted else 2.0**-8}[dtype]
        bound = u * ref.abs() + (1 + u) * (k + 1) * 2.0**-24 * (x.cpu().double().abs()
                                                               @ w.cpu().double().abs().T)
        worst = float(((y.cpu().double() - ref).abs() / bound).max())
        assert worst <= 1.0, f"M={m} N={n} K={k}: |err| / bound {worst:.2f} (seed={seed})"
        if cfg is not None and split_k > 1:
            second = ql.Fp8MatmulConfig(cfg.block_n, cfg.block_k, split_k, cfg.num_warps,
                                        cfg.num_stages, merge_here=False)  # fmt: skip
            assert torch.equal(pk.matmul_16bit(x, w, config=second, backend="triton"), y)


def test_matmul_16bit_empty_shapes():
    for backend in ("torch", "triton"):
        w = torch.zeros(32, 64, dtype=BF16)
        assert pk.matmul_16bit(torch.zeros(0, 64, dtype=BF16), w, backend=backend).shape == (0, 32)
        y = pk.matmul_16bit(torch.zeros(3, 0, dtype=BF16), torch.zeros(5, 0, dtype=BF16),
                            backend=backend)  # fmt: skip
        assert torch.equal(y, torch.zeros(3, 5, dtype=BF16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_matmul_16bit_bad_calls_change_nothing(backend):
    x = torch.zeros(4, 64, dtype=BF16)
    w = torch.zeros(32, 64, dtype=BF16)
    out = torch.full((4, 32), 7.0, dtype=BF16)
    bad = [
        (dict(x=x.float()), "x must be one of bfloat16, float16"),
        (dict(w=w.to(F16)), "w must be one of bfloat16"),
        (dict(x=x.reshape(4, 8, 8)), "x must have 2 dims"),
        (dict(w=torch.zeros(32, 48, dtype=BF16)), "share the inner dimension"),
        (dict(out=torch.empty(4, 31, dtype=BF16)), "out must be a torch.bfloat16 tensor"),
        (dict(out=torch.empty(4, 32, dtype=F16)), "out must be a torch.bfloat16 tensor"),
        (dict(out=torch.empty(32, 4, dtype=BF16).T), "contiguous rows"),
    ]
    for change, message in bad:
        args = dict(x=x, w=w, out=out) | change
        with pytest.raises(ValueError, match=message):
            pk.matmul_16bit(args["x"], args["w"], out=args["out"], backend=backend)
        assert torch.equal(out, torch.full((4, 32), 7.0, dtype=BF16))


def test_pick_config_16bit_keeps_the_bytes_of_a_step():
    """``pick_config_16bit``: ``pick_config``'s tiles with half the columns a step (the same
    bytes of 16-bit weights as of e4m3 ones) and no promotion."""
    from pagedattn_kernels.quant.triton_launch import pick_config, pick_config_16bit

    for m, n, k in ((1, 6144, 4096), (16, 28672, 4096), (64, 4096, 14336), (128, 4096, 4096)):
        fp8, half = pick_config(m, n, k, sms=132), pick_config_16bit(m, n, k, sms=132)
        assert half.block_k * 2 == fp8.block_k and not half.promote
        assert (half.block_n, half.split_k, half.num_stages) == (fp8.block_n, fp8.split_k,
                                                                 fp8.num_stages)  # fmt: skip


def test_pick_config_follows_the_shape():
    """The per-shape tiles (``pick_config``): from 33 rows, many output rows unsplit in 128-row
    tiles, a long K split in 64-row tiles of 256-byte steps, the rest unsplit in 64-row tiles
    with a deep pipeline; up to 32 rows, gate/up, down and the square output projection in
    unsplit 64 x 256 tiles with their own pipeline depths; fast accumulation turns promotion
    off."""
    from pagedattn_kernels.quant.triton_launch import pick_config

    gate_up = pick_config(64, 28672, 4096, sms=132)
    assert (gate_up.block_n, gate_up.split_k, gate_up.promote) == (128, 1, True)
    down = pick_config(64, 4096, 14336, sms=132, fast_accum=True)
    assert (down.block_n, down.block_k, down.split_k, down.promote) == (64, 256, 0, False)
    qkv = pick_config(16, 6144, 4096, sms=132)
    assert (qkv.block_n, qkv.block_k, qkv.split_k, qkv.num_stages) == (64, 128, 1, 8)
    assert pick_config(128, 6144, 4096, sms=132).num_stages == 6  # a 128-token tile
    assert pick_config(64, 28672, 4096, sms=264).block_n == 64  # too few tiles for the SMs
    for m in (1, 16, 32):
        small = {name: pick_config(m, n, k, sms=132)
                 for name, n, k in (("gate_up", 28672, 4096), ("down", 4096, 14336),
                                    ("o", 4096, 4096))}  # fmt: skip
        for name, cfg in small.items():
            assert (cfg.block_n, cfg.block_k, cfg.split_k) == (64, 256, 1), (m, name)
        assert {name: cfg.num_stages for name, cfg in small.items()} == {
            "gate_up": 4, "down": 8, "o": 6}
    assert pick_config(33, 4096, 4096, sms=132).block_k == 128  # past 32 rows: as before


def test_fp8_matmul_empty_shapes():
    xq = torch.zeros(0, 64, dtype=FP8)
    wq = torch.zeros(32, 64, dtype=FP8)
    for backend in ("torch", "triton"):
        assert pk.fp8_matmul(xq, torch.ones(0), wq, torch.ones(32), backend=backend).shape == (0, 32)
        y = pk.fp8_matmul(torch.zeros(3, 0, dtype=FP8), torch.ones(3), torch.zeros(5, 0, dtype=FP8),
                          torch.ones(5), backend=backend)  # fmt: skip
        assert torch.equal(y, torch.zeros(3, 5, dtype=BF16))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_matmul_bad_calls_change_nothing(backend):
    xq = torch.zeros(4, 64, dtype=FP8)
    wq = torch.zeros(32, 64, dtype=FP8)
    xs, ws = torch.ones(4, 1), torch.ones(1, 32)
    out = torch.full((4, 32), 7.0, dtype=BF16)
    bad = [
        (dict(xq=xq.float()), "xq must be one of float8_e4m3fn"),
        (dict(wq=wq.to(BF16)), "wq must be one of float8_e4m3fn"),
        (dict(wq=torch.zeros(32, 48, dtype=FP8)), "share the inner dimension"),
        (dict(x_scale=torch.ones(3, 1)), "x_scale must hold one float32 scale per row of xq"),
        (dict(w_scale=torch.ones(32, 2)), "w_scale must hold one float32 scale per row of wq"),
        (dict(w_scale=torch.ones(32, dtype=torch.float64)), "w_scale must be one of float32"),
        (dict(out_dtype=torch.int8), "out_dtype must be"),
        (dict(out=torch.empty(4, 31, dtype=BF16)), "out must be a torch.bfloat16 tensor"),
        (dict(out=torch.empty(32, 4, dtype=BF16).T), "contiguous rows"),
    ]
    for change, message in bad:
        args = dict(xq=xq, x_scale=xs, wq=wq, w_scale=ws, out=out) | change
        with pytest.raises(ValueError, match=message):
            pk.fp8_matmul(args["xq"], args["x_scale"], args["wq"], args["w_scale"],
                          out=args["out"], out_dtype=args.get("out_dtype", BF16),
                          backend=backend)  # fmt: skip
        assert torch.equal(out, torch.full((4, 32), 7.0, dtype=BF16))
