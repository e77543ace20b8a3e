"""fp8 KV caches and fp8 quantization against exact references.

- the e4m3 reference itself (every code, nearest-value search) against torch's cast;
- ``reshape_and_cache`` into fp8 caches: each element the e4m3 value nearest to ``x / scale``,
  ties to even, clamped at +-448 (bit-exact on every target);
- decode and mixed prefill attention reading fp8 caches, against the float64 reference that
  dequantizes exactly (``fp8 * scale``): the error is then only the query dtype's;
- copy-on-write and swaps of fp8 blocks (bytes moved unchanged);
- ``quantize_fp8_per_token``: exact against its reference, and the error bound that makes it a
  quantizer (Hypothesis);
- bad calls: a clear ``ValueError`` and nothing written.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import pagedattn_kernels as pk
from pagedattn_kernels import reference
from pagedattn_kernels.testing import TOLERANCE, poisoned_like, random_paged_batch, rel_error

F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as numbers (fp8 -0 equals +0), NaN nowhere."""
    a64, b64 = a.to(torch.float64).cpu(), b.to(torch.float64).cpu()
    return bool(torch.isfinite(a64).all()) and torch.equal(a64, b64)


def _scale(value: float, device: str) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=device)


# --------------------------------------------------------------------------- e4m3 reference


def test_e4m3_values_are_the_codes_torch_decodes():
    """The reference's grid (built from the format's definition) is exactly the set of finite
    values of the 256 codes as torch decodes them."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).to(torch.float64)
    finite = sorted(set(codes[torch.isfinite(codes)].tolist()))
    assert reference.e4m3_values().tolist() == finite
    assert len(finite) == 253 and finite[-1] == 448.0 and finite[1] == -finite[-2]


@settings(max_examples=200)
@given(st.floats(min_value=-600.0, max_value=600.0, allow_nan=False, width=32))
def test_nearest_e4m3_is_torch_cast(x):
    """Round to nearest, ties to even, clamp at 448: the reference's search and torch's cast
    (two implementations) agree everywhere, including midpoints and the subnormal range."""
    t = torch.tensor([x], dtype=torch.float32)
    want = t.clamp(-448.0, 448.0).to(FP8)
    assert _same_values(reference.nearest_e4m3(t, None), want)


def test_nearest_e4m3_ties_and_carries():
    """Midpoints go to the even code; a round-up that carries into the exponent (7.97 -> 8,
    the value Triton's interpreter gets wrong without help) lands on the next binade."""
    got = reference.nearest_e4m3(
        torch.tensor([1.0625, 1.1875, 7.97, 2.0**-10, 3 * 2.0**-10, 500.0, -1e9]), None
    )
    assert got.to(torch.float64).tolist() == [1.0, 1.25, 8.0, 0.0, 2.0**-8, 448.0, -448.0]


# --------------------------------------------------------------------------- cache writes

WRITE_CASES = [(64, F32, 16, 1), (80, BF16, 8, 3), (128, F16, 32, 2)]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: f"d{c[0]}-{c[1]}-bs{c[2]}-h{c[3]}")
def test_reshape_and_cache_fp8(target, seed, case):
    head_dim, dtype, block_size, num_kv_heads = case
    gen = target.generator(seed)
    dev = target.device
    num_blocks = 64 if target.full else 5
    num_tokens = 40 * block_size if target.full else 2 * block_size + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen, device=dev).to(FP8)
    value_cache = torch.randn(shape, generator=gen, device=dev).to(FP8)
    # K/V sliced from one fused projection; magnitudes from subnormal to past the clamp.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen, device=dev)
    spread = torch.exp(3 * torch.randn(num_tokens, 1, 1, generator=gen, device=dev))
    fused = (fused * spread).to(dtype)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=dev)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen, device=dev) < 0.2] = -1
    k_scale, v_scale = _scale(0.37, dev), _scale(2.5, dev)

    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots, k_scale=k_scale,
                                v_scale=v_scale)  # fmt: skip
    pk.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale=k_scale,
                         v_scale=v_scale, backend=target.backend)  # fmt: skip
    assert _same_values(key_cache, want_k), f"seed={seed}"
    assert _same_values(value_cache, want_v), f"seed={seed}"
    # Without scales: 1.0.
    pk.reshape_and_cache(key, value, key_cache, value_cache, slots, backend=target.backend)
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    assert _same_values(key_cache, want_k) and _same_values(value_cache, want_v), f"seed={seed}"


# --------------------------------------------------------------------------- attention

# (head_dim, query dtype, block_size, queries per KV head)
ATTN_CASES = [(64, F32, 16, 1), (80, BF16, 8, 3), (128, F16, 32, 4), (128, BF16, 16, 8)]


def _fp8_batch(target, seed, case, lens, q_lens):
    head_dim, dtype, block_size, group = case
    gen = target.generator(seed)
    num_kv_heads = 4 if target.full else 1
    batch = random_paged_batch(
        gen, lens, q_lens, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=target.device,
    )  # fmt: skip
    # fp8 caches of values around 4 (scales 0.25 and 0.5 make them about 1 and 2).
    batch.key_cache = (4 * batch.key_cache.float()).to(FP8)
    batch.value_cache = (4 * batch.value_cache.float()).to(FP8)
    return batch, _scale(0.25, target.device), _scale(0.5, target.device)


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"d{c[0]}-{c[1]}-bs{c[2]}-g{c[3]}")
def test_decode_reads_fp8(target, seed, case):
    dtype, block_size = case[1], case[2]
    lens = [1, block_size, 2 * block_size + 5, 37, 0]
    if target.full:
        lens += [1000, 4099, 9000]
    batch, ks, vs = _fp8_batch(target, seed, case, lens, [1] * len(lens))
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(*args, k_scale=ks, v_scale=vs)
    splits = (None, 3) if target.backend == "triton" else (None,)
    for num_splits in splits:  # the split path merges partial outputs that carry v_scale
        out = pk.paged_decode_attention(
            *args, k_scale=ks, v_scale=vs, out=poisoned_like(batch.query),
            backend=target.backend, num_splits=num_splits,
        )  # fmt: skip
        err = rel_error(out, ref)
        assert err < TOLERANCE[dtype], f"splits={num_splits}: rel error {err:.2e} (seed={seed})"
    # A float cache holding the same (dequantized) values gives the same answer.
    kf = (batch.key_cache.float() * 0.25).to(dtype)
    vf = (batch.value_cache.float() * 0.5).to(dtype)
    plain = pk.paged_decode_attention(batch.query, kf, vf, batch.block_tables, batch.seq_lens,
                                      backend=target.backend)  # fmt: skip
    assert rel_error(plain, ref) < TOLERANCE[dtype], f"seed={seed}"


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize("magnitude,orthogonal", [(1.0, False), (3e4, True), (1e6, True)])
def test_fp8_products_in_float16(target, seed, kernel, magnitude, orthogonal):
    """On an fp8 cache the attention kernels multiply bfloat16 queries in float16
    (``f16_products``, the default of both configs) or in bfloat16: both match the float64
    reference, and so do queries beyond float16's range (65,504), which the kernels divide by
    a power of two first (in float16 without it, 1e6 is inf and the output NaN).

    One component of every query row is large (``magnitude`` times 0.5-1). ``orthogonal``:
    the keys are zero there, so the scores come from the other components (about 1) alone,
    which the scaling must keep: at 1e6 the kernel divides by 2^5. Not orthogonal, such
    queries are ill-conditioned for any fp32 softmax: keys sharing the large component's e4m3
    code tie, and fp32 scores of 1e6 round away what separates them (1% off the float64
    reference at 1e6). Near 1e30 the scores also pass 2^24 in log2 units, where the folded
    FMA of ``_attend_tile`` loses them: on an H200 that gave NaN and zero rows."""
    if target.backend != "triton":
        pytest.skip("a Triton kernel option")
    from pagedattn_kernels.attention import triton_launch as tl_

    block_size = 16
    lens = [1, 37, 3 * block_size + 5] + ([4099] if target.full else [])
    q_lens = [1] * len(lens) if kernel == "decode" else [1, 20, 3 * block_size + 5][: len(lens)]
    q_lens += [300] * (len(lens) - len(q_lens))
    batch, ks, vs = _fp8_batch(target, seed, (128, BF16, block_size, 4), lens, q_lens)
    q = batch.query.float()
    q[..., 0] = magnitude * (0.5 + 0.5 * torch.rand(q.shape[:2], device=q.device))
    batch.query = q.to(BF16)
    if orthogonal:
        batch.key_cache[..., 0] = 0.0
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    scales = {"k_scale": ks, "v_scale": vs}
    if kernel == "decode":
        ref = reference.paged_decode_attention(*args, **scales)
    else:
        ref = reference.paged_attention(*args, batch.cu_query_lens, **scales)
    for f16 in (True, False):
        if kernel == "decode":
            cfg = tl_.DecodeConfig(64 if not target.full else 128, 4, 1 if not target.full else 3,
                                   f16_products=f16)  # fmt: skip
            runs = [tl_.paged_decode_attention(*args, 128**-0.5, max(lens),
                                               poisoned_like(batch.query), num_splits=splits,
                                               config=cfg, **scales)
                    for splits in (1, 3)]  # fmt: skip
        else:
            base = tl_.prefill_config(128, BF16, 4, interpreted=not target.full)
            cfg = tl_.PrefillConfig(base.block_m, base.tile_n, base.num_warps, base.num_stages,
                                    f16_products=f16)  # fmt: skip
            runs = [tl_.paged_attention(*args, batch.cu_query_lens, 128**-0.5,
                                        poisoned_like(batch.query), config=cfg, **scales)]
        for out in runs:
            assert torch.isfinite(out).all(), f"f16={f16} (seed={seed})"
            err = rel_error(out, ref)
            assert err < TOLERANCE[BF16], f"f16={f16}: rel error {err:.2e} (seed={seed})"


@pytest.mark.parametrize("case", [(128, BF16, 16, 4), (80, F16, 8, 3), (64, BF16, 32, 1)],
                         ids=lambda c: f"d{c[0]}-{c[1]}-bs{c[2]}-g{c[3]}")  # fmt: skip
def test_decode_fp8_packed_loads(target, seed, case):
    """``DecodeConfig.packed_loads``: K and V tiles read as int32 words of four e4m3 values
    and widened in registers. The same float16 values reach the same products, so in the
    interpreter the output equals the element-wise loads' bit for bit; on a GPU the hardware
    conversion runs and the outputs agree to the tolerance (the compiler may order the sums
    differently). Ragged tiles, a padded head dim (80) and the split path included."""
    if target.backend != "triton":
        pytest.skip("a Triton kernel option")
    from pagedattn_kernels.attention import triton_launch as tl_

    head_dim, dtype, block_size, _ = case
    lens = [1, 37, 2 * block_size + 5, 0] + ([4099, 700] if target.full else [130])
    batch, ks, vs = _fp8_batch(target, seed, case, lens, [1] * len(lens))
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(*args, k_scale=ks, v_scale=vs)
    tile, stages = (64, 1) if not target.full else (128, 3)
    for splits in (1, 3):
        outs = [
            tl_.paged_decode_attention(
                *args, head_dim**-0.5, max(lens), poisoned_like(batch.query), num_splits=splits,
                config=tl_.DecodeConfig(tile, 4, stages, packed_loads=packed), k_scale=ks,
                v_scale=vs,
            )
            for packed in (False, True)
        ]  # fmt: skip
        err = rel_error(outs[1], ref)
        assert err < TOLERANCE[dtype], f"splits={splits}: rel error {err:.2e} (seed={seed})"
        if not target.full:
            assert torch.equal(outs[0], outs[1]), f"splits={splits} (seed={seed})"


@pytest.mark.parametrize("case", [(128, BF16, 16, 4), (80, F16, 8, 3), (64, BF16, 32, 1)],
                         ids=lambda c: f"d{c[0]}-{c[1]}-bs{c[2]}-g{c[3]}")  # fmt: skip
def test_decode_fp8_narrow_tiles(target, seed, case):
    """``FP8_NARROW``, ``FP8_ONE_WARP`` (and ``FP8_PLANNED_ONE_WARP``, its two-stage form) and
    ``FP8_LONG``, the tiles of many (sequence, KV head) pairs on an fp8 cache: 64 tokens and
    two warps, 32 tokens and one warp, 64 tokens and one warp per program. Against the float64 reference, unsplit and split, ragged tiles and a
    padded head dim (80) included; on a GPU also as the launcher chooses them for batches of
    many pairs (``FP8_LONG`` for these long contexts)."""
    if target.backend != "triton":
        pytest.skip("a Triton kernel configuration")
    from pagedattn_kernels.attention import triton_launch as tl_

    head_dim, dtype, block_size, _ = case
    lens = [1, 31, 32, 33, 2 * block_size + 5, 0] + ([4099, 700, 1000] if target.full else [130])
    batch, ks, vs = _fp8_batch(target, seed, case, lens, [1] * len(lens))
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ref = reference.paged_decode_attention(*args, k_scale=ks, v_scale=vs)
    for cfg in (tl_.FP8_NARROW, tl_.FP8_ONE_WARP, tl_.FP8_PLANNED_ONE_WARP, tl_.FP8_LONG):
        for splits in (1, 3):
            out = tl_.paged_decode_attention(
                *args, head_dim**-0.5, max(lens), poisoned_like(batch.query),
                num_splits=splits, config=cfg, k_scale=ks, v_scale=vs,
            )  # fmt: skip
            err = rel_error(out, ref)
            msg = f"{cfg.tile_n}x{cfg.num_warps} splits={splits}: rel error {err:.2e} (seed={seed})"
            assert err < TOLERANCE[dtype], msg
    if not target.full:
        return
    for pairs in (tl_.FP8_NARROW_TILE_PAIRS, tl_.FP8_ONE_WARP_PAIRS):  # the launcher's choice
        copies = -(-pairs // (len(lens) * batch.key_cache.shape[2]))
        q = batch.query.repeat(copies, 1, 1)
        tables, seq_lens = batch.block_tables.repeat(copies, 1), batch.seq_lens.repeat(copies)
        out = pk.paged_decode_attention(q, batch.key_cache, batch.value_cache, tables, seq_lens,
                                        k_scale=ks, v_scale=vs, out=poisoned_like(q))  # fmt: skip
        err = rel_error(out, ref.repeat(copies, 1, 1))
        assert err < TOLERANCE[dtype], f"{copies} copies: rel error {err:.2e} (seed={seed})"


def test_packed_loads_need_word_aligned_rows(target, seed):
    """Caches whose rows cannot be read as 4-byte words (here views one byte into their
    storage) take element-wise loads even with ``packed_loads``: the same output as aligned
    caches. On a GPU word loads there would fault (misaligned address); the interpreter
    reads unaligned words, so on the CPU this checks ``_word_aligned`` and the fallback's
    output."""
    if target.backend != "triton":
        pytest.skip("a Triton kernel option")
    from pagedattn_kernels.attention import triton_launch as tl_

    batch, ks, vs = _fp8_batch(target, seed, (64, BF16, 16, 2), [5, 40], [1, 1])

    def shifted(cache: torch.Tensor) -> torch.Tensor:
        store = torch.empty(cache.numel() + 1, dtype=FP8, device=cache.device)
        store[1:].copy_(cache.flatten())
        return store[1:].view(cache.shape)

    kc, vc = shifted(batch.key_cache), shifted(batch.value_cache)
    assert not tl_._word_aligned(kc) and tl_._word_aligned(batch.key_cache)
    assert not tl_._word_aligned(torch.zeros(4, 16, 2, 66, dtype=FP8)[..., :62])
    cfg = tl_.DecodeConfig(64, 4, 1, packed_loads=True)
    outs = [tl_.paged_decode_attention(batch.query, k, v, batch.block_tables, batch.seq_lens,
                                       0.125, 40, poisoned_like(batch.query), num_splits=1,
                                       config=cfg, k_scale=ks, v_scale=vs)
            for k, v in ((batch.key_cache, batch.value_cache), (kc, vc))]  # fmt: skip
    assert torch.equal(outs[0], outs[1]), f"seed={seed}"


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"d{c[0]}-{c[1]}-bs{c[2]}-g{c[3]}")
def test_mixed_batch_reads_fp8(target, seed, case):
    """Fresh prefills, a chunk continuing a cached prefix, decodes and an empty chunk."""
    dtype, block_size = case[1], case[2]
    pairs = [(23, 23), (40, 9), (1, 1), (2 * block_size, 1), (30, 0), (block_size + 3, 5)]
    if target.full:
        pairs += [(1500, 1500), (4100, 700), (300, 64)]
    lens, q_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    batch, ks, vs = _fp8_batch(target, seed, case, lens, q_lens)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
            batch.cu_query_lens)  # fmt: skip
    ref = reference.paged_attention(*args, k_scale=ks, v_scale=vs)
    out = pk.paged_attention(*args, k_scale=ks, v_scale=vs, out=poisoned_like(batch.query),
                             backend=target.backend)  # fmt: skip
    err = rel_error(out, ref)
    assert err < TOLERANCE[dtype], f"rel error {err:.2e} (seed={seed})"


def test_write_then_read_roundtrip(target, seed):
    """What the engine does in one layer: quantize this step's K/V into the cache, then attend
    over them; the answer is attention over the quantized values, close to the float one."""
    gen = target.generator(seed)
    dev = target.device
    lens = [50, 17] if not target.full else [3000, 17, 700]
    heads, kv_heads, dim, bs = 4, 2, 64, 16
    batch = random_paged_batch(gen, lens, lens, num_heads=heads, num_kv_heads=kv_heads,
                               head_dim=dim, block_size=bs, dtype=BF16, device=dev)  # fmt: skip
    cache_k = torch.zeros(batch.key_cache.shape, dtype=FP8, device=dev)
    cache_v = torch.zeros_like(cache_k)
    tokens = sum(lens)
    key = torch.randn(tokens, kv_heads, dim, generator=gen, device=dev).to(BF16)
    value = torch.randn(tokens, kv_heads, dim, generator=gen, device=dev).to(BF16)
    slots = []
    for i, n in enumerate(lens):
        table = batch.block_tables[i].tolist()
        slots += [table[p // bs] * bs + p % bs for p in range(n)]
    slot_mapping = torch.tensor(slots, device=dev)
    ks, vs = _scale(0.02, dev), _scale(0.015, dev)  # amax of N(0,1) over a few thousand ~ 4.5
    pk.reshape_and_cache(key, value, cache_k, cache_v, slot_mapping, k_scale=ks, v_scale=vs,
                         backend=target.backend)  # fmt: skip
    out = pk.paged_attention(batch.query, cache_k, cache_v, batch.block_tables, batch.seq_lens,
                             batch.cu_query_lens, k_scale=ks, v_scale=vs, backend=target.backend)
    exact_k, exact_v = batch.key_cache.clone(), batch.value_cache.clone()
    pk.reshape_and_cache(key, value, exact_k, exact_v, slot_mapping, backend="torch")
    ref = reference.paged_attention(batch.query, exact_k, exact_v, batch.block_tables,
                                    batch.seq_lens, batch.cu_query_lens)  # fmt: skip
    # e4m3 keeps 3 mantissa bits: ~2-3% relative error per element, less after averaging.
    assert rel_error(out, ref) < 0.05, f"seed={seed}"


# --------------------------------------------------------------------------- blocks


def test_copy_and_swap_fp8_blocks(target, seed):
    gen = target.generator(seed)
    dev = target.device
    kv = torch.randn(2, 2, 12, 16, 2, 64, generator=gen, device=dev).to(FP8)
    mapping = torch.tensor([[0, 5], [2, 3], [7, 11]])
    want = kv.clone()
    reference.copy_blocks(want, mapping)
    pk.copy_blocks(kv, mapping.to(dev), backend=target.backend)
    assert torch.equal(kv.view(torch.uint8), want.view(torch.uint8)), f"seed={seed}"
    host = torch.zeros(2, 2, 6, 16, 2, 64, dtype=FP8)
    if dev == "cuda":
        host = host.pin_memory()
    out_pairs = torch.tensor([[5, 0], [3, 4], [11, 2]])
    want_host = host.clone()
    reference.swap_blocks(kv, want_host, out_pairs)
    pk.swap_blocks(kv, host, out_pairs)
    if dev == "cuda":
        pk.swap_stream(kv.device).synchronize()
    assert torch.equal(host.view(torch.uint8), want_host.view(torch.uint8)), f"seed={seed}"


# --------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_quantize_fp8_per_token_exact(target, seed, dtype):
    gen = target.generator(seed)
    rows, cols = (512, 14336) if target.full else (6, 300)
    x = torch.randn(rows, cols, generator=gen, device=target.device)
    x = x * torch.exp(3 * torch.randn(rows, 1, generator=gen, device=target.device))
    # Within float16's range: a row with an infinity has no finite scale (and failed 1 run in 4).
    x = x.clamp(-60000.0, 60000.0).to(dtype)
    x[1] = 0  # an all-zero row: the smallest scale, zeros
    q, s = pk.quantize_fp8_per_token(x, backend=target.backend)
    want_q, want_s = reference.quantize_fp8_per_token(x.cpu() if target.full else x)
    assert q.dtype == FP8 and s.dtype == F32 and tuple(s.shape) == (rows, 1)
    assert torch.equal(s.cpu(), want_s.cpu()), f"seed={seed}"
    assert _same_values(q, want_q), f"seed={seed}"
    # Into given buffers, from a strided view.
    wide = torch.zeros(rows, 2 * cols, dtype=dtype, device=target.device)
    wide[:, ::2] = x
    out = torch.empty(rows, cols, dtype=FP8, device=target.device)
    scale_out = torch.empty(rows, 1, device=target.device)
    got = pk.quantize_fp8_per_token(wide[:, ::2], out=out, scale_out=scale_out,
                                    backend=target.backend)  # fmt: skip
    assert got[0] is out and got[1] is scale_out
    assert _same_values(out, q) and torch.equal(scale_out, s)


def _near_ties(scale: torch.Tensor) -> torch.Tensor:
    """float32 values whose quotients x / scale sit within two float32 ulps of the midpoints
    between neighbouring e4m3 values, where a quotient off by an ulp picks the wrong code:
    every midpoint times ``scale``, nudged by -2..2 ulps, both signs."""
    grid = reference.e4m3_values()
    pos = grid[grid > 0]
    near = ((pos[:-1] + pos[1:]) / 2).to(torch.float32) * scale
    up, down = [near], [near]
    for _ in range(2):
        up.append(torch.nextafter(up[-1], torch.tensor(float("inf"))))
        down.append(torch.nextafter(down[-1], torch.tensor(0.0)))
    vals = torch.cat(up + down[1:])
    return torch.cat([vals, -vals])


def _random_scale(gen: torch.Generator) -> torch.Tensor:
    """A float32 scale of 2^-8..2^8 with a random significand (a power of two would make every
    quotient exact)."""
    exponent = int(torch.randint(-8, 8, (1,), generator=gen))
    return (2.0**exponent * (1 + torch.rand(1, generator=gen))).to(torch.float32)


def _near_ties_rows(gen: torch.Generator, rows: int) -> torch.Tensor:
    """Rows of ``_near_ties`` values, each led by its largest magnitude 448 * s (its scale is
    then the float32 quotient by 448, which the midpoints are taken against)."""
    out = []
    for _ in range(rows):
        amax = (torch.tensor(448.0) * _random_scale(gen)).to(torch.float32)
        out.append(torch.cat([amax, _near_ties(amax / torch.tensor(448.0))]))
    return torch.stack(out)


def test_reshape_and_cache_fp8_near_ties(target, seed):
    """Cache writes divide by the layer's scale exactly as IEEE does (``_quotient``: one
    reciprocal, an FMA correction), next to the e4m3 midpoints too."""
    gen = torch.Generator().manual_seed(seed)
    dev = target.device
    k_scale, v_scale = _random_scale(gen), _random_scale(gen)
    heads, dim = 2, 64
    k = _near_ties(k_scale)
    v = _near_ties(v_scale)
    tokens = min(len(k), len(v)) // (heads * dim)
    key = k[: tokens * heads * dim].view(tokens, heads, dim).to(dev)
    value = v[: tokens * heads * dim].view(tokens, heads, dim).to(dev)
    shape = (-(-tokens // 16), 16, heads, dim)
    key_cache = torch.zeros(shape, dtype=FP8, device=dev)
    value_cache = torch.zeros(shape, dtype=FP8, device=dev)
    slots = torch.arange(tokens, device=dev)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    scales = {"k_scale": k_scale.to(dev), "v_scale": v_scale.to(dev)}
    reference.reshape_and_cache(key, value, want_k, want_v, slots, **scales)
    pk.reshape_and_cache(key, value, key_cache, value_cache, slots, backend=target.backend,
                         **scales)  # fmt: skip
    for got, want in ((key_cache, want_k), (value_cache, want_v)):
        wrong = (got.float() != want.float()).sum()
        assert wrong == 0, f"{int(wrong)} of {got.numel()} codes differ (seed={seed})"


def test_quantize_fp8_per_token_near_ties(target, seed):
    """The kernel's quotient is exactly IEEE x / scale (``_quotient``: a reciprocal per row
    and an FMA correction, no division per value) where it matters most: next to the e4m3
    rounding midpoints. A product by the reciprocal alone is off by an ulp often enough that
    dozens of these values take the other code."""
    gen = torch.Generator().manual_seed(seed)
    x = _near_ties_rows(gen, 4).to(target.device)
    q, s = pk.quantize_fp8_per_token(x, backend=target.backend)
    want_q, want_s = reference.quantize_fp8_per_token(x.cpu())
    assert torch.equal(s.cpu(), want_s), f"seed={seed}"
    wrong = (q.cpu().float() != want_q.float()).sum()
    assert wrong == 0, f"{int(wrong)} of {q.numel()} codes differ (seed={seed})"


@pytest.mark.parametrize("cols", [16384, 16385, 20000])
def test_quantize_fp8_per_token_one_pass_and_two(seed, cols):
    """Rows up to 16,384 wide are read once (held in registers), wider ones twice, in chunks:
    both give the reference's values (Triton in the interpreter)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, cols, generator=gen) * torch.tensor([[1e-3], [1.0], [300.0]])
    q, s = pk.quantize_fp8_per_token(x, backend="triton")
    want_q, want_s = reference.quantize_fp8_per_token(x)
    assert torch.equal(s, want_s) and _same_values(q, want_q), f"seed={seed}"


@pytest.mark.parametrize("block", [None, 64, 128])
def test_quantize_fp8_per_token_tiled(target, seed, block):
    """The tiled kernels (each tile's largest magnitude per row, then the tiles quantized from
    those maxima) give the reference's bits and the per-row kernel's, for tiles that split a
    row into several chunks (their count not a power of two, the last one partial), a ragged
    last row tile, rows of very different magnitudes and an all-zero row."""
    if target.backend != "triton":
        pytest.skip("the tiled kernels are Triton's")
    from pagedattn_kernels.quant import triton_launch

    gen = target.generator(seed)
    dev = target.device
    shapes = [(512, 14336), (37, 4096), (3, 1000)] if target.full else [(5, 300), (3, 1000)]
    for rows, cols in shapes:
        x = torch.randn(rows, cols, generator=gen, device=dev)
        x = (x * torch.exp(3 * torch.randn(rows, 1, generator=gen, device=dev))).to(BF16)
        x[rows // 2] = 0
        got = [torch.empty(rows, cols, dtype=FP8, device=dev), torch.empty(rows, 1, device=dev)]
        triton_launch.quantize_fp8_per_token(x, *got, tiled=True, block=block)
        per_row = [torch.empty_like(got[0]), torch.empty_like(got[1])]
        triton_launch.quantize_fp8_per_token(x, *per_row, tiled=False)
        want_q, want_s = reference.quantize_fp8_per_token(x.cpu())
        what = f"{rows}x{cols} block={block} seed={seed}"
        assert torch.equal(got[1].cpu(), want_s) and _same_values(got[0].cpu(), want_q), what
        assert torch.equal(got[1], per_row[1]) and _same_values(got[0], per_row[0]), what


@settings(max_examples=60)
@given(arrays("float32", st.tuples(st.integers(1, 4), st.integers(1, 40)),
              elements=st.floats(-1e4, 1e4, width=32)))  # fmt: skip
def test_quantize_fp8_per_token_error_bound(values):
    """Every element comes back within half an e4m3 step: |q * s - x| <= |x| / 16 in the normal
    range, 2^-10 * s below it (plus the float32 division's rounding)."""
    x = torch.from_numpy(values)
    q, s = pk.quantize_fp8_per_token(x, backend="torch")
    assert bool((s > 0).all())
    back = q.to(torch.float64) * s.to(torch.float64)
    x64 = x.to(torch.float64)
    bound = torch.maximum(x64.abs() / 16, 2.0**-10 * s.to(torch.float64)) * (1 + 1e-6)
    assert bool(((back - x64).abs() <= bound).all())
    assert bool((q.to(torch.float64).abs() <= 448).all())


# --------------------------------------------------------------------------- bad calls


def test_scales_on_float_caches_are_refused(seed):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(3, 16, 2, 64, generator=gen)
    vc = torch.randn(3, 16, 2, 64, generator=gen)
    before = kc.clone(), vc.clone()
    key = torch.randn(2, 2, 64, generator=gen)
    with pytest.raises(ValueError, match="fp8 caches only"):
        pk.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1]), k_scale=_scale(1.0, "cpu"))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    q = torch.randn(1, 2, 64, generator=gen)
    with pytest.raises(ValueError, match="fp8 caches only"):
        pk.paged_decode_attention(q, kc, vc, torch.tensor([[0]], dtype=torch.int32),
                                  torch.tensor([3], dtype=torch.int32), v_scale=_scale(1.0, "cpu"))


@pytest.mark.parametrize(
    "scale, match",
    [
        (torch.tensor([1.0, 2.0]), "one element"),
        (torch.tensor([1.0], dtype=torch.float64), "float32"),
        (0.5, "float32 tensor"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_scales_change_nothing(seed, scale, match, backend):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(3, 16, 2, 64, generator=gen).to(FP8)
    vc = torch.randn(3, 16, 2, 64, generator=gen).to(FP8)
    before = kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone()
    key = torch.randn(2, 2, 64, generator=gen)
    with pytest.raises(ValueError, match=match):
        pk.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 1]), k_scale=scale,
                             backend=backend)  # fmt: skip
    assert torch.equal(kc.view(torch.uint8), before[0])
    assert torch.equal(vc.view(torch.uint8), before[1])
    out = torch.full((1, 2, 64), float("nan"))
    with pytest.raises(ValueError, match=match):
        pk.paged_decode_attention(key[:1], kc, vc, torch.tensor([[0]], dtype=torch.int32),
                                  torch.tensor([3], dtype=torch.int32), k_scale=scale, out=out,
                                  backend=backend)  # fmt: skip
    assert bool(out.isnan().all())


def test_missing_scales(monkeypatch):
    """What the kernels get for ``k_scale=None``: a 16-bit cache's kernels never read a scale
    and get the cache itself (nothing allocated, so a CUDA graph capture may come first); an
    fp8 cache gets a 1.0 kept per device, which a capture cannot make (its kernel would only
    be recorded), so a first use inside one is refused with a clear error."""
    from types import SimpleNamespace

    from pagedattn_kernels import common

    bf16 = torch.zeros(2, 16, 1, 8, dtype=torch.bfloat16)
    assert common.scale_or_unit(None, bf16) is bf16
    given = torch.tensor([0.5])
    assert common.scale_or_unit(given, bf16.to(FP8)) is given
    unit = common.scale_or_unit(None, bf16.to(FP8))
    assert unit.dtype == torch.float32 and unit.tolist() == [1.0]
    assert common.scale_or_unit(None, bf16.to(FP8)) is unit  # kept, not made again
    fresh_gpu_cache = SimpleNamespace(dtype=FP8, device=torch.device("cuda", 99))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="CUDA graph capture"):
        common.scale_or_unit(None, fresh_gpu_cache)
    assert torch.device("cuda", 99) not in common._UNITS


def test_fp8_query_or_mismatched_caches_are_refused(seed):
    gen = torch.Generator().manual_seed(seed)
    kc = torch.randn(3, 16, 2, 64, generator=gen).to(FP8)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="query"):
        pk.paged_decode_attention(torch.zeros(1, 2, 64, dtype=FP8), kc, kc, tables, lens)
    with pytest.raises(ValueError, match="must match"):
        pk.paged_decode_attention(torch.zeros(1, 2, 64), kc, kc.float(), tables, lens)
    with pytest.raises(ValueError, match="out"):
        pk.paged_decode_attention(torch.zeros(1, 2, 64), kc, kc, tables, lens,
                                  out=torch.zeros(1, 2, 64, dtype=BF16))  # fmt: skip


def test_quantize_bad_calls():
    with pytest.raises(ValueError, match="2 dims"):
        pk.quantize_fp8_per_token(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="float"):
        pk.quantize_fp8_per_token(torch.zeros(2, 3, dtype=torch.int32))
    out = torch.zeros(2, 3, dtype=BF16)
    with pytest.raises(ValueError, match="out must be"):
        pk.quantize_fp8_per_token(torch.zeros(2, 3), out=out)
    assert bool((out == 0).all())
    with pytest.raises(ValueError, match="scale_out"):
        pk.quantize_fp8_per_token(torch.zeros(2, 3), scale_out=torch.zeros(2))
