"""The fused elementwise ops (RMSNorm, fused add + RMSNorm, SiLU-and-multiply, rotary
embedding) on every backend, against two references:

- the float64 math (``pagedattn_kernels.reference``), within the error that the defined
  roundings allow (two or three roundings to the dtype: about one dtype epsilon, relative);
- the unfused torch composition the Llama model runs (Hugging Face's numerics, written out
  here once more), which the kernels copy rounding for rounding. The torch backend must equal
  it bit for bit (it *is* that composition: the CPU model relies on it). The Triton kernels may
  differ only where their transcendentals or their sum order differ from torch's: in a rare
  element of a 16-bit dtype (at most 2 ulps: one ulp of an intermediate, scaled by a factor
  below 2) and by a few ulps in float32.

Inputs are fresh random tensors each run (the seed is printed; ``PAGEDATTN_TEST_SEED`` replays
one). Small shapes on CPU (the interpreter), full sizes on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.testing import ulp_distance

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
EPS = {F32: 2.0**-23, F16: 2.0**-10, BF16: 2.0**-7}  # distance from 1 to the next value
# Relative error allowed against the float64 math: 16-bit outputs round twice or three times
# (each <= eps / 2); float32 adds fp32 transcendentals, rsqrt and sums (a few 2^-24).
REL_TOL = {F32: 8 * EPS[F32], F16: 1.01 * EPS[F16], BF16: 1.01 * EPS[BF16]}
# Triton vs the torch composition: most elements identical, the rest this close (see module).
# float32: two orders of adding up 4096 squares may differ by several ulps (half of it reaches
# the output through rsqrt); 16 leaves room for the GPU's reduction tree.
MAX_ULPS = {F32: 16, F16: 2, BF16: 2}


def _tiny(dtype: torch.dtype) -> float:
    """Absolute slack for results in the subnormal range of ``dtype`` (float16 mostly)."""
    return 8 * torch.finfo(dtype).smallest_normal * EPS[dtype]


def _assert_close_to_f64(out: torch.Tensor, ref64: torch.Tensor, scale: torch.Tensor, what: str):
    """|out - ref| <= REL_TOL * scale + tiny, elementwise (scale: |ref| or a term magnitude)."""
    err = (out.double() - ref64).abs()
    bound = REL_TOL[out.dtype] * scale + _tiny(out.dtype)
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {worst:.3f}x the allowed bound vs float64"


def _assert_like_torch(out: torch.Tensor, want: torch.Tensor, target, what: str):
    """Bit-identical on the torch backend; ulp-close with rare differences on Triton."""
    if target.backend == "torch":
        assert torch.equal(out, want), f"{what}: the torch path must be the composition itself"
        return
    ulps = ulp_distance(out, want)
    assert int(ulps.max()) <= MAX_ULPS[out.dtype], f"{what}: {int(ulps.max())} ulps from torch"
    if out.dtype != F32:
        differ = int((ulps > 0).sum())
        assert differ <= 1 + out.numel() // 100, f"{what}: {differ}/{out.numel()} differ from torch"


# --------------------------------------------------------------------------- the compositions
# What models/layers.py computes unfused (Hugging Face's Llama), written out independently.


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def hf_rotary(positions, x, inv_freq):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------- RMSNorm

# (rows, hidden, dtype): powers of two and not (SmolLM2's 576), one row and many.
NORM_CASES = [
    (1, 64, F32),
    (7, 200, BF16),
    (33, 576, F16),
    (20, 1000, BF16),
    (9, 4096, F32),
    (3, 96, F16),
    (12, 4096, BF16),
]


def _norm_inputs(target, seed, case):
    rows, hidden, dtype = case
    rows = 1024 + rows if target.full else rows
    gen = target.generator(seed)
    dev = target.device
    # Rows of very different magnitudes; norm weights in [0.5, 1.5].
    scale = torch.exp(2 * torch.randn(rows, 1, generator=gen, device=dev))
    x = (torch.randn(rows, hidden, generator=gen, device=dev) * scale).to(dtype)
    residual = (torch.randn(rows, hidden, generator=gen, device=dev) * scale).to(dtype)
    weight = (0.5 + torch.rand(hidden, generator=gen, device=dev)).to(dtype)
    eps = float(torch.rand((), generator=gen, device=dev)) * 1e-5 + 1e-6
    return x, residual, weight, eps


@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_rms_norm(target, seed, case):
    x, _, weight, eps = _norm_inputs(target, seed, case)
    before = x.clone()
    out = pk.rms_norm(x, weight, eps, backend=target.backend)
    assert torch.equal(x, before), "x must not change"
    ref = reference.rms_norm(x, weight, eps)
    _assert_close_to_f64(out, ref, ref.abs(), f"rms_norm seed={seed}")
    _assert_like_torch(out, hf_rms_norm(x, weight, eps), target, f"rms_norm seed={seed}")
    # In place, and into a row slice of a wider buffer.
    buf = torch.zeros(x.shape[0], x.shape[1] + 8, dtype=x.dtype, device=x.device)
    assert pk.rms_norm(x, weight, eps, out=buf[:, 4:-4], backend=target.backend) is not None
    assert torch.equal(buf[:, 4:-4], out) and not buf[:, :4].any() and not buf[:, -4:].any()
    y = x.clone()
    assert pk.rms_norm(y, weight, eps, out=y, backend=target.backend) is y
    assert torch.equal(y, out), f"in place differs, seed={seed}"


@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_fused_add_rms_norm(target, seed, case):
    x, residual, weight, eps = _norm_inputs(target, seed, case)
    x0, r0 = x.clone(), residual.clone()
    normed, new_residual = pk.fused_add_rms_norm(x, residual, weight, eps, backend=target.backend)
    assert torch.equal(x, x0) and torch.equal(residual, r0), "out of place must not write inputs"
    ref, ref_residual = reference.fused_add_rms_norm(x0, r0, weight, eps)
    assert torch.equal(new_residual, x0 + r0), f"the residual sum is exact, seed={seed}"
    assert torch.equal(new_residual.double(), ref_residual), f"seed={seed}"
    _assert_close_to_f64(normed, ref, ref.abs(), f"fused_add_rms_norm seed={seed}")
    want = hf_rms_norm(r0 + x0, weight, eps)  # Hugging Face: hidden = residual + hidden
    _assert_like_torch(normed, want, target, f"fused_add_rms_norm seed={seed}")
    # In place (vLLM's form): the sum into residual, the norm into x; same bits.
    out, res = pk.fused_add_rms_norm(x, residual, weight, eps, out=x, residual_out=residual,
                                     backend=target.backend)  # fmt: skip
    assert out is x and res is residual
    assert torch.equal(x, normed) and torch.equal(residual, new_residual), f"seed={seed}"
    # Swapped buffers (the sum into x, the norm into residual) still read before writing.
    x, residual = x0.clone(), r0.clone()
    pk.fused_add_rms_norm(x, residual, weight, eps, out=residual, residual_out=x,
                          backend=target.backend)  # fmt: skip
    assert torch.equal(residual, normed) and torch.equal(x, new_residual), f"seed={seed}"


def test_norms_take_leading_dims_and_strided_inputs(target, seed):
    gen = target.generator(seed)
    dev = target.device
    big = torch.randn(2, 5, 3 * 160, generator=gen, device=dev).to(BF16)
    x = big[..., ::3]  # [2, 5, 160], stride 3 in the last dim: read through a copy
    residual = torch.randn(2, 5, 160, generator=gen, device=dev).to(BF16)
    weight = (0.5 + torch.rand(160, generator=gen, device=dev)).to(BF16)
    normed, new_res = pk.fused_add_rms_norm(x, residual, weight, 1e-6, backend=target.backend)
    assert normed.shape == x.shape and new_res.shape == x.shape
    assert torch.equal(new_res, x + residual)
    _assert_like_torch(normed, hf_rms_norm(x + residual, weight, 1e-6), target, f"seed={seed}")
    single = pk.rms_norm(x[0, 0], weight, 1e-6, backend=target.backend)  # one row, 1-D
    _assert_like_torch(single, hf_rms_norm(x[0, 0], weight, 1e-6), target, f"seed={seed}")


# --------------------------------------------------------------------------- SiLU and multiply

# (rows, intermediate, dtype); Llama 3 8B's 14336 at full size on the GPU.
SILU_CASES = [
    (1, 64, F32),
    (13, 300, BF16),
    (8, 1000, F16),
    (5, 1408, BF16),
    (3, 96, F32),
    (6, 14336, BF16),
]


@pytest.mark.parametrize("case", SILU_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}")
def test_silu_and_mul(target, seed, case):
    rows, inter, dtype = case
    rows = 512 + rows if target.full else rows
    gen = target.generator(seed)
    dev = target.device
    # The gate/up projection's output inside a wider buffer (a row stride != 2 * inter).
    buf = (4 * torch.randn(rows, 2 * inter + 16, generator=gen, device=dev)).to(dtype)
    x = buf[:, 8 : 8 + 2 * inter]
    before = buf.clone()
    out = pk.silu_and_mul(x, backend=target.backend)
    assert torch.equal(buf, before) and out.shape == (rows, inter)
    ref = reference.silu_and_mul(x)
    _assert_close_to_f64(out, ref, ref.abs(), f"silu_and_mul seed={seed}")
    gate, up = x[:, :inter], x[:, inter:]
    _assert_like_torch(out, F.silu(gate) * up, target, f"silu_and_mul seed={seed}")
    into = torch.full((rows, inter), float("nan"), dtype=dtype, device=dev)
    assert pk.silu_and_mul(x, out=into, backend=target.backend) is into
    assert torch.equal(into, out)
    three_d = pk.silu_and_mul(x.reshape(1, rows, 2 * inter), backend=target.backend)
    assert torch.equal(three_d[0], out)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_rounding_to_nearest_even(target, dtype):
    """Products that fall exactly halfway between two values of the dtype round to the even
    one, as torch rounds (Triton's interpreter truncates bfloat16: the kernels round in
    integer arithmetic there). silu(g) == g exactly for g >= 32, so the output is g * up
    rounded once; g and up with few mantissa bits make every 128th product a tie."""
    dev = target.device
    a = torch.arange(128, device=dev, dtype=torch.float32)
    gate = 32 * (1 + a[:, None] / 128).expand(128, 128)
    up = (1 + a[None, :] / 128).expand(128, 128)
    x = torch.cat((gate, up), dim=1).to(dtype)
    exact = gate.double() * up.double()
    ties = (exact.to(dtype).double() - exact).abs() * 2 == ulp_step(exact, dtype)
    assert int(ties.sum()) > 50  # the test has teeth
    out = pk.silu_and_mul(x, backend=target.backend)
    assert torch.equal(out, F.silu(x[:, :128]) * x[:, 128:])


def ulp_step(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` values around each (normal, positive) value."""
    exponent = torch.floor(torch.log2(values))
    return torch.exp2(exponent) * EPS[dtype]


# --------------------------------------------------------------------------- rotary embedding

# (tokens, heads, kv heads or None, head_dim, dtype, rope base)
ROTARY_CASES = [
    (1, 4, 4, 64, F32, 10000.0),
    (9, 8, 2, 128, BF16, 500000.0),
    (17, 6, 2, 80, F16, 10000.0),
    (5, 3, 1, 96, BF16, 1e6),
    (7, 2, None, 32, F32, 10000.0),
    (11, 9, 3, 64, BF16, 100000.0),
]


@pytest.mark.parametrize(
    "case", ROTARY_CASES, ids=lambda c: f"t{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-{c[4]}"
)
def test_rotary_embedding(target, seed, case):
    tokens, heads, kv_heads, head_dim, dtype, base = case
    tokens = 700 + tokens if target.full else tokens
    gen = target.generator(seed)
    dev = target.device
    kvh = kv_heads or 0
    # Q and K rotated in place as views of one fused QKV output, V next to them untouched.
    qkv = torch.randn(tokens, (heads + 2 * kvh) * head_dim, generator=gen, device=dev).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kvh) * head_dim].view(tokens, kvh, head_dim)
    key = k if kv_heads is not None else None
    positions = torch.randint(0, 1 << 15, (tokens,), generator=gen, device=dev)
    positions[0] = 0
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim)
    before = qkv.clone()
    q0, k0 = q.clone(), k.clone()
    pk.rotary_embedding(positions, q, key, inv_freq, backend=target.backend)
    v_start = (heads + kvh) * head_dim
    assert torch.equal(qkv[:, v_start:], before[:, v_start:]), "V must stay untouched"
    half = head_dim // 2
    for name, got, orig in (("query", q, q0), ("key", k, k0)):
        if name == "key" and key is None:
            assert torch.equal(got, orig)
            continue
        pair = orig.double().abs()
        scale = torch.cat((pair[..., :half] + pair[..., half:],) * 2, dim=-1)
        ref = reference.rotary_embedding(positions, orig, inv_freq)
        _assert_close_to_f64(got, ref, 1.5 * scale, f"{name} seed={seed}")
        want = hf_rotary(positions, orig, inv_freq)
        if target.backend == "torch":
            assert torch.equal(got, want), f"{name}: the torch path must be the composition"
        else:
            # A cos/sin that differs in its last fp32 bit may round to the neighbouring dtype
            # value: the result moves by at most eps * (|x1| + |x2|).
            diff = (got.double() - want.double()).abs()
            assert bool((diff <= 2 * EPS[dtype] * scale).all()), f"{name} seed={seed}"
            if dtype != F32:
                differ = int((diff > 0).sum())
                assert differ <= 1 + got.numel() // 100, f"{name}: {differ} differ, seed={seed}"


# --------------------------------------------------------------------------- edge cases


def test_empty_batches(target):
    dev = target.device
    for dtype in (F32, BF16):
        x = torch.empty(0, 64, dtype=dtype, device=dev)
        w = torch.ones(64, dtype=dtype, device=dev)
        assert pk.rms_norm(x, w, 1e-6, backend=target.backend).shape == (0, 64)
        a, b = pk.fused_add_rms_norm(x, x.clone(), w, 1e-6, backend=target.backend)
        assert a.shape == b.shape == (0, 64)
        assert pk.silu_and_mul(torch.empty(0, 64, dtype=dtype, device=dev),
                               backend=target.backend).shape == (0, 32)  # fmt: skip
        q = torch.empty(0, 4, 64, dtype=dtype, device=dev)
        pos = torch.empty(0, dtype=torch.int64, device=dev)
        inv = torch.ones(32, device=dev)
        pk.rotary_embedding(pos, q, q.clone(), inv, backend=target.backend)


def _rejected(fn, *tensors, match: str):
    before = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=match):
        fn()
    for t, b in zip(tensors, before):
        assert torch.equal(t, b), "a rejected call must not write"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_are_rejected_and_change_nothing(backend):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=gen)
    r = torch.randn(4, 32, generator=gen)
    w = torch.ones(32)
    kw = {"backend": backend}

    _rejected(
        lambda: pk.rms_norm(x, w[:16], 1e-6, **kw), x, match=r"weight must have shape \(32,\)"
    )
    _rejected(lambda: pk.rms_norm(x, w.half(), 1e-6, **kw), x, match="cast the weight")
    _rejected(lambda: pk.rms_norm(x.long(), w, 1e-6, **kw), x, match="float32, float16")
    _rejected(lambda: pk.rms_norm(x, w, -1.0, **kw), x, match="eps must be")
    _rejected(lambda: pk.rms_norm(x, w, float("nan"), **kw), x, match="eps must be")
    _rejected(lambda: pk.rms_norm(x, w, True, **kw), x, match="eps must be")
    out_t = torch.zeros(32, 4).t()  # the right shape, but columns one stride apart
    _rejected(lambda: pk.rms_norm(x, w, 1e-6, out=out_t, **kw), x, out_t, match="stride 1")
    out_h = torch.zeros(4, 32, dtype=F16)
    _rejected(
        lambda: pk.rms_norm(x, w, 1e-6, out=out_h, **kw), x, out_h, match="must be torch.float32"
    )
    _rejected(
        lambda: pk.rms_norm(x, w, 1e-6, out=torch.zeros(4, 31), **kw), x, match="out must have"
    )
    _rejected(lambda: pk.rms_norm(torch.zeros(4, 0), w[:0], 1e-6, **kw), x, match="hidden > 0")

    _rejected(lambda: pk.fused_add_rms_norm(x, r[:3], w, 1e-6, **kw), x, r, match="residual must")
    _rejected(
        lambda: pk.fused_add_rms_norm(x, r.bfloat16(), w, 1e-6, **kw), x, r, match="must match"
    )
    _rejected(lambda: pk.fused_add_rms_norm(x, r, w, 1e-6, out=x, residual_out=x, **kw), x, r,
              match="different tensors")  # fmt: skip
    _rejected(lambda: pk.fused_add_rms_norm(x, r, w, 1e-6, out=x, residual_out=out_t, **kw), x, r,
              out_t, match="stride 1")  # fmt: skip

    g = torch.randn(4, 33, generator=gen)
    _rejected(lambda: pk.silu_and_mul(g, **kw), g, match="2 \\* intermediate")
    g2 = torch.randn(4, 64, generator=gen)
    _rejected(lambda: pk.silu_and_mul(g2, out=torch.zeros(4, 64), **kw), g2, match="out must have")
    _rejected(lambda: pk.silu_and_mul(g2.int(), **kw), g2, match="float32")

    q = torch.randn(3, 4, 16, generator=gen)
    k = torch.randn(3, 2, 16, generator=gen)
    pos = torch.tensor([0, 5, 9])
    inv = torch.ones(8)

    def rope(*a, **extra):
        return lambda: pk.rotary_embedding(*a, **kw, **extra)

    _rejected(rope(pos.float(), q, k, inv), q, k, match="int32 or int64")
    _rejected(rope(pos[:2], q, k, inv), q, k, match=r"positions must have shape \(3,\)")
    _rejected(rope(pos, q.view(3, 64), k, inv), q, k, match="query must be")
    _rejected(rope(pos, q, k.half(), inv), q, k, match="key is torch.float16")
    _rejected(rope(pos, q, k[:2], inv), q, k, match="share tokens")
    _rejected(rope(pos, q, k, inv[:4]), q, k, match="inv_freq must have shape")
    _rejected(rope(pos, q, k, inv.double()), q, k, match="inv_freq must be float32")
    _rejected(rope(pos, q, q, inv), q, match="different tensors")
    q_odd = torch.randn(3, 4, 15, generator=gen)
    _rejected(rope(pos, q_odd, None, inv), q_odd, match="even")
    wide = torch.randn(3, 4, 32, generator=gen)
    strided = wide[..., ::2]  # head dim with stride 2: cannot be rotated in place
    _rejected(rope(pos, strided, None, inv), wide, match="stride 1")
    with pytest.raises(ValueError, match="backend="):
        pk.rms_norm(x, w, 1e-6, backend="cuda")


def test_triton_size_limits():
    x = torch.zeros(1, pk.MAX_HIDDEN + 1)
    w = torch.ones(x.shape[1])
    with pytest.raises(ValueError, match="backend='torch'"):
        pk.rms_norm(x, w, 1e-6, backend="triton")
    assert pk.rms_norm(x, w, 1e-6, backend="torch").shape == x.shape


def test_env_var_routes_cpu_tensors_to_the_interpreter(monkeypatch):
    from pagedattn_kernels.fused import triton_launch

    launches = []
    real = triton_launch.silu_and_mul
    monkeypatch.setattr(triton_launch, "silu_and_mul",
                        lambda *a: launches.append(1) or real(*a))  # fmt: skip
    x = torch.randn(3, 8)
    monkeypatch.setenv("PAGEDATTN_BACKEND", "triton")
    out = pk.silu_and_mul(x)
    assert launches and torch.allclose(out, F.silu(x[:, :4]) * x[:, 4:])
    monkeypatch.setenv("PAGEDATTN_BACKEND", "auto")
    pk.silu_and_mul(x)
    assert len(launches) == 1  # CPU tensors take the torch path by default


# --------------------------------------------------------------------------- CUDA graphs


def _assert_graph_replays_like_eager(fresh, step, seed: int) -> None:
    """Capture ``step`` on the static buffers ``fresh()`` gives, then twice copy new inputs in
    and replay: every output equals an eager ``step`` on a copy of those inputs."""
    static = fresh()
    step({k: v.clone() for k, v in static.items()})  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(static)
    for _ in range(2):
        new = fresh()
        want = step({k: v.clone() for k, v in new.items()})
        for k, v in new.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        for i, (got, exp) in enumerate(zip(outs, want)):
            assert torch.equal(got, exp), f"output {i} differs after replay, seed={seed}"


@pytest.mark.gpu
def test_all_fused_ops_replay_in_a_cuda_graph(seed):
    """Captured once, replayed on new inputs copied into the static buffers: the same results
    as eager calls (no host sync, no value-dependent allocation inside the ops)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, dtype, tokens, hidden, inter = "cuda", BF16, 64, 512, 1024
    heads, kv_heads, head_dim = 8, 2, 64

    def rand(*shape):
        return torch.randn(shape, generator=gen, device=dev).to(dtype)

    def fresh():
        return {
            "x": rand(tokens, hidden),
            "res": rand(tokens, hidden),
            "gu": rand(tokens, 2 * inter),
            "qkv": rand(tokens, (heads + 2 * kv_heads) * head_dim),
            "pos": torch.randint(0, 4096, (tokens,), generator=gen, device=dev),
        }

    weight = (0.5 + torch.rand(hidden, generator=gen, device=dev)).to(dtype)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim)

    def step(b):
        q = b["qkv"][:, : heads * head_dim].view(tokens, heads, head_dim)
        k = b["qkv"][:, heads * head_dim : (heads + kv_heads) * head_dim].view(
            tokens, kv_heads, head_dim
        )
        pk.rotary_embedding(b["pos"], q, k, inv_freq)
        n1 = pk.rms_norm(b["x"], weight, 1e-5)
        n2, r2 = pk.fused_add_rms_norm(
            b["x"], b["res"], weight, 1e-5, out=b["x"], residual_out=b["res"]
        )
        return n1, n2, r2, pk.silu_and_mul(b["gu"]), b["qkv"]

    _assert_graph_replays_like_eager(fresh, step, seed)


# --------------------------------------------------------------------------- rotary + cache write

# (tokens, heads, kv heads, head_dim, dtype, cache dtype, block size)
ROPE_CACHE_CASES = [
    (9, 8, 2, 128, BF16, BF16, 16),
    (13, 4, 4, 64, F32, F32, 8),
    (6, 6, 2, 80, F16, F16, 4),
    (11, 8, 2, 128, BF16, torch.float8_e4m3fn, 16),
    (5, 9, 3, 64, F16, torch.float8_e4m3fn, 8),
]


def _cache_bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


@pytest.mark.parametrize(
    "case", ROPE_CACHE_CASES, ids=lambda c: f"t{c[0]}-h{c[1]}-kv{c[2]}-d{c[3]}-{c[4]}-{c[5]}"
)
def test_rotary_embedding_and_cache(target, seed, case):
    """One kernel for the rotary embedding and the cache write: exactly the two ops in
    sequence on the same backend (queries, keys, both caches, bit for bit), and within the
    rotary tolerance of the float64 math; slot -1 writes nothing; Q/K/V are views of one
    fused projection output, as in the model."""
    tokens, heads, kv_heads, head_dim, dtype, cache_dtype, block_size = case
    tokens = 500 + tokens if target.full else tokens
    qkv, positions, inv_freq, caches, slots, scales = _rope_cache_inputs(
        target.generator(seed), target.device, tokens, heads, kv_heads, head_dim, dtype,
        cache_dtype, block_size,
    )  # fmt: skip

    def split(t):
        return _qkv_views(t, heads, kv_heads, head_dim)

    fused, fused_caches = qkv.clone(), [c.clone() for c in caches]
    pk.rotary_embedding_and_cache(positions, *split(fused), inv_freq, *fused_caches, slots,
                                  backend=target.backend, **scales)  # fmt: skip
    apart, apart_caches = qkv.clone(), [c.clone() for c in caches]
    q, k, v = split(apart)
    pk.rotary_embedding(positions, q, k, inv_freq, backend=target.backend)
    pk.reshape_and_cache(k, v, *apart_caches, slots, backend=target.backend, **scales)
    assert torch.equal(fused, apart), f"seed={seed}"
    for got, want in zip(fused_caches, apart_caches):
        assert torch.equal(_cache_bits(got), _cache_bits(want)), f"seed={seed}"

    q0, k0, v0 = split(qkv)
    q64, k64 = reference.rotary_embedding_and_cache(positions, q0, k0, v0, inv_freq,
                                                    *[c.clone() for c in caches], slots, **scales)  # fmt: skip
    half = head_dim // 2
    for got, want, orig in ((split(fused)[0], q64, q0), (split(fused)[1], k64, k0)):
        pair = orig.double().abs()
        scale = torch.cat((pair[..., :half] + pair[..., half:],) * 2, dim=-1)
        _assert_close_to_f64(got, want, 1.5 * scale, f"seed={seed}")
    # The caches hold what reshape_and_cache's reference stores for the op's own rotated keys
    # (as numbers: fp8 has a -0), and nothing else changed.
    ref_caches = [c.clone() for c in caches]
    reference.reshape_and_cache(split(fused)[1], v0, *ref_caches, slots, **scales)
    for got, want in zip(fused_caches, ref_caches):
        assert torch.equal(got.double(), want.double()), f"seed={seed}"
    written = torch.zeros(caches[0].shape[0] * block_size, dtype=torch.bool,
                          device=target.device)  # fmt: skip
    written[slots[slots >= 0]] = True
    for got, orig in zip(fused_caches, caches):
        kept = _cache_bits(got).flatten(0, 1)[~written], _cache_bits(orig).flatten(0, 1)[~written]
        assert torch.equal(*kept), "slot -1 and unused slots stay untouched"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rotary_embedding_and_cache_rejects_and_changes_nothing(backend):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, generator=gen)
    k = torch.randn(3, 2, 16, generator=gen)
    v = torch.randn(3, 2, 16, generator=gen)
    kc, vc = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    pos, inv, slots = torch.tensor([0, 5, 9]), torch.ones(8), torch.tensor([0, 3, 7])
    everything = (q, k, v, kc, vc)

    def call(*, q=q, k=k, v=v, kc=kc, vc=vc, pos=pos, slots=slots, **extra):
        return lambda: pk.rotary_embedding_and_cache(pos, q, k, v, inv, kc, vc, slots,
                                                     backend=backend, **extra)  # fmt: skip

    _rejected(call(k=None), *everything, match="key must be a tensor")
    _rejected(call(v=v[:, :1]), *everything, match="differ in shape")
    _rejected(call(slots=torch.tensor([0, 3, 8])), *everything, match="slot_mapping holds")
    _rejected(call(pos=pos[:2]), *everything, match="positions must have shape")
    _rejected(call(kc=kc[..., :8], vc=vc[..., :8]), *everything, match="head dim|caches hold")
    _rejected(call(k_scale=torch.ones(1)), *everything, match="fp8 caches only")
    _rejected(call(v=k), *everything, match="must not share memory")
    with pytest.raises(ValueError, match="rotary_embedding_and_cache"):
        call(slots=torch.tensor([0, 3, 99]))()


def test_rotary_embedding_and_cache_empty(target):
    dev = target.device
    q = torch.empty(0, 4, 64, device=dev)
    k = torch.empty(0, 2, 64, device=dev)
    kc = torch.randn(2, 4, 2, 64, device=dev)
    before = kc.clone()
    pk.rotary_embedding_and_cache(torch.empty(0, dtype=torch.int64, device=dev), q, k, k.clone(),
                                  torch.ones(32, device=dev), kc, kc.clone(),
                                  torch.empty(0, dtype=torch.int64, device=dev),
                                  backend=target.backend)  # fmt: skip
    assert torch.equal(kc, before)


# --------------------------------------------------------------------------- rotary split over heads
# Compiled, small batches split each token's heads over several programs (grid axis 1); the
# interpreter never does by itself, so these tests force it (the launchers' ``split`` and
# ``groups``) and ask for the unsplit kernels' bits.

# (heads, kv heads or None, head_dim, dtype, cache dtype, (query heads, key heads) a program)
ROTARY_SPLIT_CASES = [
    (32, 8, 128, BF16, BF16, (8, 4)),  # Llama-3-8B, the launcher's groups
    (32, 8, 128, BF16, torch.float8_e4m3fn, (8, 4)),
    (9, 3, 64, F16, F16, (4, 2)),  # heads not multiples of the groups
    (9, 3, 64, F16, torch.float8_e4m3fn, (8, 1)),
    (4, 1, 80, F32, F32, (2, 1)),  # head_dim padding (40 of 64), one KV head
    (6, 2, 80, BF16, torch.float8_e4m3fn, (4, 4)),  # a key group wider than the KV heads
    (6, None, 64, F16, None, (4, 4)),  # no key
    (5, None, 80, BF16, None, (1, 1)),  # a head a program
]


def _split_id(case) -> str:
    heads, kv_heads, head_dim, dtype, cache_dtype, groups = case
    name = str(dtype).removeprefix("torch.")
    cache = str(cache_dtype).removeprefix("torch.") if cache_dtype else "nocache"
    return f"h{heads}-kv{kv_heads}-d{head_dim}-{name}-{cache}-g{groups[0]}x{groups[1]}"


def _split_inputs(dev, seed, tokens, case):
    """``_rope_cache_inputs`` for a case of the split tests."""
    heads, kv_heads, head_dim, dtype, cache_dtype, _ = case
    gen = torch.Generator(device=dev).manual_seed(seed)
    return _rope_cache_inputs(gen, dev, tokens, heads, kv_heads or 0, head_dim, dtype,
                              cache_dtype)  # fmt: skip


def _rope_cache_inputs(gen, dev, tokens, heads, kvh, head_dim, dtype, cache_dtype, block_size=16):
    """A fused QKV output (``_qkv_views`` cuts Q, K, V out of it), positions, inv_freq, two
    random caches and slots with some -1 (no caches with ``cache_dtype`` None)."""
    qkv = torch.randn(tokens, (heads + 2 * kvh) * head_dim, generator=gen, device=dev)
    qkv = qkv.to(dtype)
    positions = torch.randint(0, 1 << 15, (tokens,), generator=gen, device=dev)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim)
    if cache_dtype is None:
        return qkv, positions, inv_freq, None, None, {}
    num_blocks = -(-tokens // block_size) + 2
    shape = (num_blocks, block_size, kvh, head_dim)
    caches = [torch.randn(shape, generator=gen, device=dev).to(cache_dtype) for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=dev)[:tokens]
    slots[torch.rand(tokens, generator=gen, device=dev) < 0.2] = -1
    scales = {}
    if cache_dtype == torch.float8_e4m3fn:
        scales = {
            "k_scale": torch.tensor([0.05], device=dev),
            "v_scale": torch.tensor([0.8], device=dev),
        }
    return qkv, positions, inv_freq, caches, slots, scales


def _qkv_views(qkv, heads, kv_heads, head_dim):
    tokens, kvh = qkv.shape[0], kv_heads or 0
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kvh) * head_dim].view(tokens, kvh, head_dim)
    v = qkv[:, (heads + kvh) * head_dim :].view(tokens, kvh, head_dim)
    return q, (k if kv_heads is not None else None), v


def _run_rotary(case, inputs, **grid):
    """One launch of the Triton rotary kernel (with the cache write when the case has caches)
    on copies of the inputs; returns the QKV buffer and the caches after it."""
    from pagedattn_kernels.fused import triton_launch

    heads, kv_heads, head_dim = case[:3]
    qkv, positions, inv_freq, caches, slots, scales = inputs
    qkv = qkv.clone()
    q, k, v = _qkv_views(qkv, heads, kv_heads, head_dim)
    if caches is None:
        triton_launch.rotary_embedding(positions, q, k, inv_freq, **grid)
        return qkv, []
    caches = [c.clone() for c in caches]
    triton_launch.rotary_embedding_and_cache(positions, q, k, v, inv_freq, *caches, slots,
                                             scales.get("k_scale"), scales.get("v_scale"),
                                             **grid)  # fmt: skip
    return qkv, caches


def _assert_same_bits(got, want, what: str) -> None:
    (qkv, caches), (want_qkv, want_caches) = got, want
    assert torch.equal(qkv, want_qkv), f"{what}: query, key or value differ"
    for i, (c, w) in enumerate(zip(caches, want_caches)):
        assert torch.equal(_cache_bits(c), _cache_bits(w)), f"{what}: cache {i} differs"


def _check_split(dev, seed, tokens, case) -> None:
    """Split (the case's groups, and the launcher's) = unsplit, bit for bit; and the split
    result is the torch path's within the rotary tolerance (the interpreter's cos/sin are
    numpy's), its caches hold exactly what ``reshape_and_cache`` stores for its keys, V and
    slot -1 stay untouched."""
    heads, kv_heads, head_dim, dtype, _, groups = case
    inputs = _split_inputs(dev, seed, tokens, case)
    what = f"{tokens} tokens {_split_id(case)} seed={seed}"
    unsplit = _run_rotary(case, inputs, split=False)
    _assert_same_bits(_run_rotary(case, inputs, split=True, groups=groups), unsplit, what)
    _assert_same_bits(_run_rotary(case, inputs, split=True), unsplit, f"{what} default groups")
    _assert_same_bits(_run_rotary(case, inputs), unsplit, f"{what} the launcher's choice")

    qkv0, positions, inv_freq, caches, slots, scales = inputs
    got_qkv, got_caches = unsplit
    q0, k0, v0 = _qkv_views(qkv0, heads, kv_heads, head_dim)
    q, k, v = _qkv_views(got_qkv, heads, kv_heads, head_dim)
    assert torch.equal(v, v0), f"{what}: V must stay untouched"
    ref_qkv = qkv0.clone()
    rq, rk, _ = _qkv_views(ref_qkv, heads, kv_heads, head_dim)
    pk.rotary_embedding(positions, rq, rk, inv_freq, backend="torch")
    half = head_dim // 2
    for name, out, want, orig in (("query", q, rq, q0), ("key", k, rk, k0)):
        if orig is None:
            continue
        pair = orig.double().abs()
        scale = torch.cat((pair[..., :half] + pair[..., half:],) * 2, dim=-1)
        diff = (out.double() - want.double()).abs()
        assert bool((diff <= 2 * EPS[dtype] * scale).all()), f"{what}: {name} vs torch"
        if dtype != F32:
            differ = int((diff > 0).sum())
            assert differ <= 1 + out.numel() // 100, f"{what}: {name}: {differ} differ from torch"
    if caches is None:
        return
    ref_caches = [c.clone() for c in caches]
    reference.reshape_and_cache(k, v0, *ref_caches, slots, **scales)
    for c, w in zip(got_caches, ref_caches):
        assert torch.equal(c.double(), w.double()), f"{what}: cache vs reshape_and_cache"
    written = torch.zeros(caches[0].shape[0] * caches[0].shape[1], dtype=torch.bool,
                          device=slots.device)  # fmt: skip
    written[slots[slots >= 0]] = True
    for c, orig in zip(got_caches, caches):
        kept = _cache_bits(c).flatten(0, 1)[~written], _cache_bits(orig).flatten(0, 1)[~written]
        assert torch.equal(*kept), f"{what}: slot -1 and unused slots stay untouched"


@pytest.mark.parametrize("case", ROTARY_SPLIT_CASES, ids=_split_id)
def test_rotary_split_over_heads_interpreted(seed, case):
    """The split grid in Triton's interpreter (forced: it never splits by itself), 1 and
    several tokens: the unsplit kernels' bits."""
    for tokens in (1, 7):
        _check_split("cpu", seed, tokens, case)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
@pytest.mark.parametrize("case", ROTARY_SPLIT_CASES, ids=_split_id)
def test_rotary_split_over_heads_compiled(seed, case, tokens):
    """The compiled split grid (the launcher takes it at 16 and 64 tokens of Llama-3-8B on an
    H200, not at 300; forced here at every count) against the compiled unsplit kernels."""
    _check_split("cuda", seed, tokens, case)


def test_rotary_split_rule(monkeypatch):
    """Compiled, a split while the split grid has at most ROTARY_SPLIT_PER_SM programs per SM;
    interpreted, never unless forced; a split into one program per token is none."""
    from pagedattn_kernels.fused import triton_launch as tl_

    monkeypatch.setattr(tl_, "sm_count", lambda device: 132)
    compiled, cuda = object(), torch.device("cuda")

    def grid(kernel, tokens, heads, kv_heads, half_pad, cache, split=None, groups=None):
        return tl_._rotary_grid(kernel, cuda, tokens, heads, kv_heads, half_pad, cache, split,
                                groups)  # fmt: skip

    # Llama-3-8B: 4 programs of 8 query heads, 2 of 4 key heads (with the cache write) or 1
    # of 8 (rotary alone); 6 * 88 = 528 = 4 * 132 programs.
    assert tl_.rotary_head_groups(32, 8, 64, True) == (8, 4)
    assert tl_.rotary_head_groups(32, 8, 64, False) == (8, 8)
    assert grid(compiled, 16, 32, 8, 64, True) == (1, 6, 8, 4, 4)
    assert grid(compiled, 88, 32, 8, 64, True)[1] == 6
    assert grid(compiled, 89, 32, 8, 64, True) == (1, 1, 32, 8, 4)
    assert grid(compiled, 105, 32, 8, 64, False)[1] == 5
    assert grid(compiled, 106, 32, 8, 64, False)[1] == 1
    assert grid(compiled, 300, 32, 8, 64, True, split=True)[1] == 6
    assert grid(compiled, 16, 32, 8, 64, True, split=False)[1] == 1
    assert grid(compiled, 16, 9, 3, 32, True, groups=(4, 2)) == (1, 5, 4, 2, 4)
    assert grid(compiled, 16, 4, 0, 32, False)[1] == 1  # one query group, no key: no split
    kernel = pk_kernels("rotary_and_cache_kernel")
    assert grid(kernel, 16, 32, 8, 64, True)[1] == 1
    assert grid(kernel, 16, 32, 8, 64, True, split=True)[1] == 6
    with pytest.raises(ValueError, match="powers of two"):
        grid(compiled, 16, 32, 8, 64, True, split=True, groups=(6, 2))


def pk_kernels(name: str):
    """An interpreted fused kernel (what CPU tensors get)."""
    from pagedattn_kernels.common import kernels_for

    return getattr(kernels_for(torch.device("cpu"), "pagedattn_kernels.fused.triton_kernels"),
                   name)  # fmt: skip
