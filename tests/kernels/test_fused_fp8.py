"""The fused ops that quantize their output to fp8 (``rms_norm_fp8``, ``fused_add_rms_norm_fp8``,
``silu_and_mul_fp8``) on every backend.

Their contract is exact, so most of this file checks bits (fp8 codes compared as uint8, scales
and residuals with ``torch.equal``):

- each op is the unfused composition bit for bit on the same backend (but for the compiled
  norms' sum order: ``_assert_nearly_same_fp8``): ``rms_norm`` /
  ``fused_add_rms_norm`` / ``silu_and_mul`` followed by ``quantize_fp8_per_token`` of the rows
  (codes, scales, the new residual), for every float dtype, widths that are powers of two and
  not, one row and many (several programs in the interpreter), rows of very different
  magnitudes, an all-zero row (the smallest scale, 1 / (448 * 512), and zero codes) and, for
  SiLU, a row small enough that its scale is that floor too (subnormal e4m3 codes);
- leading dims and strided inputs give what the contiguous 2-D input gives, in the documented
  shapes; ``residual_out=residual`` updates the caller's tensor in place;
- against the float64 references (``pagedattn_kernels.reference``): scales within the dtype's
  rounding, every code at most one e4m3 step from the reference's, and few codes differing at
  all (the bound and why it holds are at ``test_close_to_the_float64_reference``);
- bad inputs: a clear ``ValueError`` and nothing written; the Triton path's width limit;
- (GPU) capture and replay in a CUDA graph.

Inputs are fresh random tensors each run (the seed is printed; ``PAGEDATTN_TEST_SEED`` replays
one). Small shapes on CPU (the Triton interpreter), full sizes on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import reference

from .test_fused_ops import _assert_graph_replays_like_eager, _rejected

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn
DTYPES = [F32, F16, BF16]
EPS = {F32: 2.0**-23, F16: 2.0**-10, BF16: 2.0**-7}  # distance from 1 to the next value
# The scale of a row whose largest magnitude is below 448 / (448 * 512): vLLM's floor, float32.
MIN_SCALE = torch.tensor(1.0 / (448.0 * 512.0), dtype=F32)

OPS = ["rms_norm_fp8", "fused_add_rms_norm_fp8", "silu_and_mul_fp8"]

# (rows, width) on CPU and on the GPU; width is hidden for the norms, intermediate for SiLU.
# CPU: one row; 100 (not a power of two: masked columns) with 5 rows (masked rows in a tile);
# 40 x 2048, which the interpreter splits over two programs of 32 rows (the last one partial).
# GPU: Llama 3 8B's hidden 4096 and intermediate 14336, 1 to 512 rows.
SHAPES = {
    "norm": [((1, 64), (1, 4096)), ((5, 100), (37, 100)), ((40, 2048), (512, 4096))],
    "silu": [((1, 64), (1, 14336)), ((5, 100), (37, 100)), ((40, 2048), (512, 14336))],
}


def _codes(q: torch.Tensor) -> torch.Tensor:
    assert q.dtype == FP8, f"expected float8_e4m3fn, got {q.dtype}"
    return q.view(torch.uint8)


def _assert_same_fp8(got, want, what: str) -> None:
    """``(q, scale)`` pairs bit for bit: the same codes (so -0 is not +0) and scales."""
    (q, s), (wq, ws) = got, want
    assert q.shape == wq.shape and s.shape == ws.shape, f"{what}: shapes {q.shape}, {s.shape}"
    assert s.dtype == F32, f"{what}: scales are {s.dtype}"
    assert torch.equal(s, ws), f"{what}: scales differ in {int((s != ws).sum())} rows"
    differ = int((_codes(q) != _codes(wq)).sum())
    assert differ == 0, f"{what}: {differ}/{q.numel()} fp8 codes differ"


def _assert_nearly_same_fp8(got, want, what: str) -> None:
    """The compiled RMSNorm with its fp8 epilogue is another kernel than the plain one, and
    the compiler may add a row's squares in another order (as ``rms_norm`` may against torch):
    ``rsqrt`` can then differ in its last fp32 bit. Scales within a few fp32 ulps, codes at most
    one e4m3 step apart and in at most 0.1% of the elements (seen on an H200: float32 at
    512 x 4096 only; bfloat16 and float16 bit for bit)."""
    (q, s), (wq, ws) = got, want
    assert q.shape == wq.shape and s.shape == ws.shape, f"{what}: shapes {q.shape}, {s.shape}"
    rel = float(((s.double() - ws.double()).abs() / ws.double()).max()) if s.numel() else 0.0
    assert rel <= 8 * EPS[F32], f"{what}: scales {rel:.2e} apart (relative)"
    steps = (_codes(q).int() - _codes(wq).int()).abs()  # same sign: one step is one code
    assert int(steps.max()) <= 1, f"{what}: a code {int(steps.max())} steps away"
    differ = int((steps > 0).sum())
    assert differ <= max(1, q.numel() // 1000), f"{what}: {differ}/{q.numel()} codes differ"


def _inputs(target, seed, rows, width, dtype, *, silu):
    """``x [rows, 2 * width]`` (SiLU) or ``x, residual [rows, width]``, weight, eps.

    Rows span magnitudes from 2^-6 to 8 times 3 N(0, 1) (float16 products of two stay finite);
    with 3 rows or more, the last row is all zeros (in x and residual) and, for SiLU, the one
    before it is scaled by 2^-8: its products stay below 448 * MIN_SCALE, so its scale is the
    floor and its codes reach the e4m3 subnormals."""
    gen = target.generator(seed)
    dev = target.device
    cols = 2 * width if silu else width
    spread = torch.exp(1.5 * torch.randn(rows, 1, generator=gen, device=dev)).clamp(2**-6, 8.0)
    x = 3 * torch.randn(rows, cols, generator=gen, device=dev) * spread
    residual = 3 * torch.randn(rows, cols, generator=gen, device=dev) * spread
    if rows >= 3:
        x[-1] = 0
        residual[-1] = 0
        if silu:
            x[-2] = torch.randn(cols, generator=gen, device=dev) * 2.0**-8
    weight = (0.5 + torch.rand(width, generator=gen, device=dev)).to(dtype)
    eps = float(torch.rand((), generator=gen, device=dev)) * 1e-5 + 1e-6
    return x.to(dtype), residual.to(dtype), weight, eps


def _run(op, x, residual, weight, eps, backend, **extra):
    """The fused op: ``(q, scale)``, plus the new residual for the fused add."""
    if op == "rms_norm_fp8":
        return pk.rms_norm_fp8(x, weight, eps, backend=backend)
    if op == "fused_add_rms_norm_fp8":
        return pk.fused_add_rms_norm_fp8(x, residual, weight, eps, backend=backend, **extra)
    return pk.silu_and_mul_fp8(x, backend=backend)


def _unfused(op, x, residual, weight, eps, backend):
    """The contract: the unfused op on the same backend, then ``quantize_fp8_per_token`` of its
    rows as a 2-D matrix, reshaped back."""
    new_residual = None
    if op == "rms_norm_fp8":
        y = pk.rms_norm(x, weight, eps, backend=backend)
    elif op == "fused_add_rms_norm_fp8":
        y, new_residual = pk.fused_add_rms_norm(x, residual, weight, eps, backend=backend)
    else:
        y = pk.silu_and_mul(x, backend=backend)
    q, s = pk.quantize_fp8_per_token(y.reshape(-1, y.shape[-1]), backend=backend)
    out = (q.view(y.shape), s.view(*y.shape[:-1], 1))
    return out if new_residual is None else (*out, new_residual)


def _shape(target, op, case):
    small, full = SHAPES["silu" if op == "silu_and_mul_fp8" else "norm"][case]
    return full if target.full else small


# --------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("case", [0, 1, 2], ids=["one-row", "width-100", "wide"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_equals_the_unfused_composition(target, seed, op, dtype, case):
    rows, width = _shape(target, op, case)
    silu = op == "silu_and_mul_fp8"
    x, residual, weight, eps = _inputs(target, seed, rows, width, dtype, silu=silu)
    x0, r0 = x.clone(), residual.clone()
    what = f"{op} {rows}x{width} {dtype} seed={seed}"
    got = _run(op, x, residual, weight, eps, target.backend)
    assert torch.equal(x, x0) and torch.equal(residual, r0), f"{what}: inputs were written"
    want = _unfused(op, x, residual, weight, eps, target.backend)
    assert got[0].shape == (rows, width) and got[1].shape == (rows, 1), what
    if target.device == "cuda" and target.backend == "triton" and not silu:
        _assert_nearly_same_fp8(got[:2], want[:2], what)
    else:
        _assert_same_fp8(got[:2], want[:2], what)
    if op == "fused_add_rms_norm_fp8":
        assert torch.equal(got[2], want[2]), f"{what}: the new residual differs from the unfused"
        assert torch.equal(got[2], x0 + r0), f"{what}: the new residual is not x + residual"
    if rows >= 3:  # the all-zero row: the floor scale and +0 codes
        assert float(got[1][-1, 0]) == float(MIN_SCALE), f"{what}: zero row's scale"
        assert not _codes(got[0][-1]).any(), f"{what}: zero row's codes"
        if silu:  # the tiny row: floor scale, nonzero (mostly subnormal) codes
            assert float(got[1][-2, 0]) == float(MIN_SCALE), f"{what}: tiny row's scale"
            assert _codes(got[0][-2]).any(), f"{what}: tiny row quantized to nothing"
    assert bool((got[1] > 0).all()) and bool(torch.isfinite(got[0].float()).all()), what


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_fp8_every_method(target, seed, dtype):
    """Every Triton way to quantize SiLU-and-multiply's rows gives the unfused composition's
    bits: tiled (the products and each tile's largest magnitude per row, then the tiles
    quantized from those maxima; here with rows split into several tiles, the last partial),
    a program per row, and whole rows in two passes through a scratch row (with fewer
    programs than rows, so that programs take several rows in turn, and steps of columns that
    leave the last one partial)."""
    if target.backend != "triton":
        pytest.skip("the launches are Triton's")
    from pagedattn_kernels.fused import triton_launch
    from pagedattn_kernels.quant import triton_launch as quant_launch

    rows, width = (300, 14336) if target.full else (6, 5000)
    x, residual, weight, eps = _inputs(target, seed, rows, width, dtype, silu=True)
    want = _unfused("silu_and_mul_fp8", x, residual, weight, eps, target.backend)
    runs = {m: lambda q, s, m=m: triton_launch.silu_and_mul(x, x, width, fp8_out=(q, s), method=m)
            for m in triton_launch.SILU_FP8_METHODS}  # fmt: skip
    for block, per_sm in ((1024, 1), (4096, 2), (None, None)):
        runs[f"two_pass block={block} per_sm={per_sm}"] = (
            lambda q, s, b=block, p=per_sm: triton_launch._silu_and_mul_fp8_two_pass(
                x, width, q, s, block=b, per_sm=p))  # fmt: skip
    for name, run in runs.items():
        q = torch.empty(rows, width, dtype=FP8, device=x.device)
        scale = torch.empty(rows, 1, device=x.device)
        run(q, scale)
        _assert_same_fp8((q, scale), want, f"{name} {rows}x{width} {dtype} seed={seed}")
    assert quant_launch.tile_shape(rows, width, not target.full)[1] < width  # several tiles


def test_silu_and_mul_fp8_unknown_method():
    """A method that does not exist is refused, and nothing is written."""
    from pagedattn_kernels.fused import triton_launch

    x = torch.ones(2, 8)
    q = torch.zeros(2, 4, dtype=FP8)
    scale = torch.zeros(2, 1)
    with pytest.raises(ValueError, match="method must be one of"):
        triton_launch.silu_and_mul(x, x, 4, fp8_out=(q, scale), method="fast")
    assert not q.view(torch.uint8).any() and not scale.any()


# --------------------------------------------------------------------------- shapes and strides


@pytest.mark.parametrize("op", OPS)
def test_leading_dims_and_strided_inputs(target, seed, op):
    """[2, 3, width] and strided views give the contiguous 2-D input's bits, in x's leading
    shape. Width 160 and a wide buffer of 2 * 160 columns keep the row stride a multiple of 16
    elements, as the contiguous input's is: a compiled kernel is specialized on that, and the
    same specialization is what makes the comparison bit-exact on the GPU too."""
    dtype, width = BF16, 160
    silu = op == "silu_and_mul_fp8"
    x, residual, weight, eps = _inputs(target, seed, 6, width, dtype, silu=silu)
    cols = x.shape[1]
    want = _run(op, x, residual, weight, eps, target.backend)
    what = f"{op} seed={seed}"

    got = _run(op, x.view(2, 3, cols), residual.view(2, 3, cols), weight, eps, target.backend)
    assert got[0].shape == (2, 3, width) and got[1].shape == (2, 3, 1), what
    assert got[0].dtype == FP8 and got[1].dtype == F32, what
    _assert_same_fp8((got[0].view(6, width), got[1].view(6, 1)), want[:2], f"3-D {what}")
    if op == "fused_add_rms_norm_fp8":
        assert got[2].shape == (2, 3, width) and torch.equal(got[2].view(6, width), want[2])

    # Column slices of wider buffers (a fused projection's output): rows 2 * cols apart.
    wide_x = torch.zeros(6, 2 * cols, dtype=dtype, device=x.device)
    wide_r = torch.full((6, 2 * cols), 7.0, dtype=dtype, device=x.device)
    wide_x[:, :cols], wide_r[:, cols:] = x, residual
    sx, sr = wide_x[:, :cols], wide_r[:, cols:]
    assert not sx.is_contiguous() and not sr.is_contiguous()
    got = _run(op, sx, sr, weight, eps, target.backend)
    _assert_same_fp8(got[:2], want[:2], f"column slice {what}")
    if op == "fused_add_rms_norm_fp8":
        assert torch.equal(got[2], want[2]) and got[2].is_contiguous(), what

    # Every other column (no row view exists: read through a copy).
    every_other = torch.zeros(6, 2 * cols, dtype=dtype, device=x.device)
    every_other[:, ::2] = x
    got = _run(op, every_other[:, ::2], residual, weight, eps, target.backend)
    _assert_same_fp8(got[:2], want[:2], f"stride 2 {what}")

    # One row as a 1-D tensor: q [width], scale [1].
    one = _run(op, x[2], residual[2], weight, eps, target.backend)
    assert one[0].shape == (width,) and one[1].shape == (1,), what
    _assert_same_fp8((one[0].view(1, width), one[1].view(1, 1)),
                     (want[0][2:3], want[1][2:3]), f"1-D {what}")  # fmt: skip


def test_empty_batches(target):
    dev = target.device
    for dtype in (F32, BF16):
        x = torch.empty(0, 64, dtype=dtype, device=dev)
        w = torch.ones(64, dtype=dtype, device=dev)
        q, s = pk.rms_norm_fp8(x, w, 1e-6, backend=target.backend)
        assert q.shape == (0, 64) and s.shape == (0, 1) and q.dtype == FP8
        q, s, r = pk.fused_add_rms_norm_fp8(x, x.clone(), w, 1e-6, backend=target.backend)
        assert q.shape == r.shape == (0, 64) and s.shape == (0, 1)
        q, s = pk.silu_and_mul_fp8(x, backend=target.backend)
        assert q.shape == (0, 32) and s.shape == (0, 1)


def test_residual_out_in_place(target, seed):
    """``residual_out=residual``: the sum goes into the caller's tensor (no new one), x stays,
    and q / scale are those of the out-of-place call. ``residual_out`` may also be a
    preallocated buffer or x itself (every load precedes the stores)."""
    rows, width = (64, 4096) if target.full else (7, 96)
    x, residual, weight, eps = _inputs(target, seed, rows, width, BF16, silu=False)
    x0, r0 = x.clone(), residual.clone()
    want = pk.fused_add_rms_norm_fp8(x, residual, weight, eps, backend=target.backend)
    what = f"seed={seed}"
    q, s, res = pk.fused_add_rms_norm_fp8(x, residual, weight, eps, residual_out=residual,
                                          backend=target.backend)  # fmt: skip
    assert res.data_ptr() == residual.data_ptr() and res.shape == residual.shape, what
    assert torch.equal(residual, x0 + r0), f"the sum was not written in place, {what}"
    assert torch.equal(x, x0), f"x must not change, {what}"
    _assert_same_fp8((q, s), want[:2], f"in place {what}")

    buf = torch.full_like(x, float("nan"))
    q, s, res = pk.fused_add_rms_norm_fp8(x, r0, weight, eps, residual_out=buf,
                                          backend=target.backend)  # fmt: skip
    assert res is buf and torch.equal(buf, x0 + r0), what
    _assert_same_fp8((q, s), want[:2], f"into a buffer {what}")

    y = x0.clone()
    q, s, res = pk.fused_add_rms_norm_fp8(y, r0, weight, eps, residual_out=y,
                                          backend=target.backend)  # fmt: skip
    assert res is y and torch.equal(y, x0 + r0), what
    _assert_same_fp8((q, s), want[:2], f"into x {what}")


# --------------------------------------------------------------------------- float64 reference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_close_to_the_float64_reference(target, seed, op, dtype):
    """Against ``reference.<op>``: the float64 result rounded once to the dtype, quantized
    exactly. The op rounds more often (RMSNorm: the normalized value, then its product with
    the weight; SiLU: silu, then its product with up), so its dtype values y are within
    1.5 eps (relative) of the reference's, eps the dtype's spacing at 1 (float32: a few eps
    more for rsqrt, exp and sums, 8 allowed). Hence:

    - scales (fl32(amax / 448) of either) differ by at most that: 2 eps allowed (8 for float32);
    - y / scale moves by at most about 3 eps relative (2^-5.4 for bfloat16), less than the
      narrowest e4m3 rounding interval (2^-4 relative in the normal range; in the subnormal
      range the steps are 2^-9 absolute and these rows' scales keep y / scale away from it),
      so it crosses at most one rounding boundary: every code is within one e4m3 step
      (adjacent codes of one sign are adjacent integers) of the reference's;
    - codes differ only where y lands within that distance of a boundary: observed about 3%
      for bfloat16, 0.3% for float16 and none for float32 (16,000 values per call on CPU);
      allowed 8%, 1.5% and 0.1%.

    Rows here span 2^-4 to 8 times 3 N(0, 1) and none is all zeros, so no row has the floor
    scale (whose f16 subnormal y would fall outside the argument above)."""
    rows, width = (512, 14336 if op == "silu_and_mul_fp8" else 4096) if target.full else (16, 1000)
    gen = target.generator(seed)
    dev = target.device
    cols = 2 * width if op == "silu_and_mul_fp8" else width
    spread = torch.exp(1.5 * torch.randn(rows, 1, generator=gen, device=dev)).clamp(2**-4, 8.0)
    x = (3 * torch.randn(rows, cols, generator=gen, device=dev) * spread).to(dtype)
    residual = (3 * torch.randn(rows, cols, generator=gen, device=dev) * spread).to(dtype)
    weight = (0.5 + torch.rand(width, generator=gen, device=dev)).to(dtype)
    eps = 1e-5
    got = _run(op, x, residual, weight, eps, target.backend)
    xc, rc, wc = x.cpu(), residual.cpu(), weight.cpu()
    if op == "rms_norm_fp8":
        want = reference.rms_norm_fp8(xc, wc, eps)
    elif op == "fused_add_rms_norm_fp8":
        want = reference.fused_add_rms_norm_fp8(xc, rc, wc, eps)
        assert torch.equal(got[2].cpu().double(), want[2]), f"residual, seed={seed}"
    else:
        want = reference.silu_and_mul_fp8(xc)
    q, s = got[0].cpu(), got[1].cpu()
    wq, ws = want[0].cpu(), want[1].cpu()
    what = f"{op} {dtype} seed={seed}"
    assert q.shape == wq.shape and s.shape == ws.shape, what

    scale_tol = (8 if dtype == F32 else 2) * EPS[dtype]
    rel = ((s.double() - ws.double()).abs() / ws.double()).max()
    assert float(rel) <= scale_tol, f"{what}: scales {float(rel) / EPS[dtype]:.2f} eps apart"

    def ordinal(codes: torch.Tensor) -> torch.Tensor:
        # Sign-magnitude e4m3 codes -> integers in the order of the values (+0 and -0 both 0).
        c = _codes(codes).to(torch.int64)
        return torch.where(c >= 128, 128 - c, c)

    steps = (ordinal(q) - ordinal(wq)).abs()
    assert int(steps.max()) <= 1, f"{what}: a code {int(steps.max())} e4m3 steps off"
    differ = int((steps > 0).sum())
    allowed = 1 + q.numel() * {F32: 0.001, F16: 0.015, BF16: 0.08}[dtype]
    assert differ <= allowed, f"{what}: {differ}/{q.numel()} codes differ from the reference"


# --------------------------------------------------------------------------- bad calls


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_are_rejected_and_change_nothing(backend):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=gen)
    r = torch.randn(4, 32, generator=gen)
    w = torch.ones(32)
    kw = {"backend": backend}

    norm = pk.rms_norm_fp8
    add = pk.fused_add_rms_norm_fp8
    _rejected(
        lambda: norm(x, w[:16], 1e-6, **kw),
        x,
        match=r"rms_norm_fp8: weight must have shape \(32,\)",
    )
    _rejected(lambda: norm(x, w.half(), 1e-6, **kw), x, match="cast the weight")
    _rejected(lambda: norm(x.long(), w, 1e-6, **kw), x, match="float32, float16")
    _rejected(lambda: norm(x, w, -1.0, **kw), x, match="eps must be")
    _rejected(lambda: norm(torch.zeros(4, 0), w[:0], 1e-6, **kw), x, match="hidden > 0")

    _rejected(lambda: add(x, r, w[:31], 1e-6, **kw), x, r,
              match=r"fused_add_rms_norm_fp8: weight must have shape")  # fmt: skip
    _rejected(lambda: add(x, r.bfloat16(), w, 1e-6, **kw), x, r, match="must match")
    _rejected(lambda: add(x, r[:3], w, 1e-6, **kw), x, r, match="residual must have x's shape")
    _rejected(lambda: add(x, r, w, 1e-6, residual_out=r[:3], **kw), x, r,
              match=r"residual_out must have shape \(4, 32\)")  # fmt: skip
    _rejected(lambda: add(x, r, w, 1e-6, residual_out=r.double(), **kw), x, r,
              match="residual_out is torch.float64")  # fmt: skip
    out_t = torch.zeros(32, 4).t()  # the right shape, but columns one stride apart
    _rejected(lambda: add(x, r, w, 1e-6, residual_out=out_t, **kw), x, r, out_t,
              match="stride 1")  # fmt: skip

    g = torch.randn(4, 33, generator=gen)
    _rejected(
        lambda: pk.silu_and_mul_fp8(g, **kw), g, match=r"silu_and_mul_fp8: .*2 \* intermediate"
    )
    _rejected(lambda: pk.silu_and_mul_fp8(g[:, :32].int(), **kw), g, match="float32")
    _rejected(lambda: pk.silu_and_mul_fp8(torch.zeros(4, 0), **kw), g, match="intermediate > 0")


def test_triton_width_limit():
    """A Triton program holds a whole row (the scale needs its largest magnitude): wider rows
    than ``MAX_HIDDEN`` are refused with a pointer to the torch path, which takes them; the
    limit itself is accepted. One row, so the interpreter stays quick."""
    over = pk.MAX_HIDDEN + 1
    x = torch.zeros(1, over)
    w = torch.ones(over)
    for fn in (
        lambda b: pk.rms_norm_fp8(x, w, 1e-6, backend=b),
        lambda b: pk.fused_add_rms_norm_fp8(x, x, w, 1e-6, backend=b),
    ):
        with pytest.raises(ValueError, match=rf"up to {pk.MAX_HIDDEN}.*backend='torch'"):
            fn("triton")
        assert fn("torch")[0].shape == x.shape
    gu = torch.zeros(1, 2 * over)
    with pytest.raises(ValueError, match=rf"silu_and_mul_fp8: .*up to {pk.MAX_HIDDEN}"):
        pk.silu_and_mul_fp8(gu, backend="triton")
    assert pk.silu_and_mul_fp8(gu, backend="torch")[0].shape == x.shape

    gen = torch.Generator().manual_seed(1)
    edge = torch.randn(1, 2 * pk.MAX_HIDDEN, generator=gen)
    _assert_same_fp8(pk.silu_and_mul_fp8(edge, backend="triton"),
                     _unfused("silu_and_mul_fp8", edge, None, None, None, "triton"),
                     "silu_and_mul_fp8 at MAX_HIDDEN")  # fmt: skip
    edge = edge[:, : pk.MAX_HIDDEN]
    _assert_same_fp8(pk.rms_norm_fp8(edge, torch.ones(pk.MAX_HIDDEN), 1e-6, backend="triton"),
                     _unfused("rms_norm_fp8", edge, None, torch.ones(pk.MAX_HIDDEN), 1e-6,
                              "triton")[:2],
                     "rms_norm_fp8 at MAX_HIDDEN")  # fmt: skip


# --------------------------------------------------------------------------- CUDA graphs


@pytest.mark.gpu
def test_fp8_ops_replay_in_a_cuda_graph(seed):
    """Captured once, replayed on new inputs copied into the static buffers: the same bits as
    eager calls (no host sync, no value-dependent allocation inside the ops)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 Triton kernels need compute capability 8.9 or newer")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, dtype, tokens, hidden, inter = "cuda", BF16, 64, 4096, 14336

    def rand(*shape):
        return (3 * torch.randn(shape, generator=gen, device=dev)).to(dtype)

    def fresh():
        return {"x": rand(tokens, hidden), "res": rand(tokens, hidden),
                "gu": rand(tokens, 2 * inter)}  # fmt: skip

    weight = (0.5 + torch.rand(hidden, generator=gen, device=dev)).to(dtype)

    def step(b):
        q1, s1 = pk.rms_norm_fp8(b["x"], weight, 1e-5)
        q2, s2, r2 = pk.fused_add_rms_norm_fp8(b["x"], b["res"], weight, 1e-5,
                                               residual_out=b["res"])  # fmt: skip
        q3, s3 = pk.silu_and_mul_fp8(b["gu"])
        return _codes(q1), s1, _codes(q2), s2, r2, _codes(q3), s3

    _assert_graph_replays_like_eager(fresh, step, seed)
