"""Programmatic dependent launch (``pagedattn_kernels.common.use_pdl``): where it is on, and
that it changes nothing but the time.

With PDL a kernel may start while the previous one still runs; each kernel waits at its top
for the previous one's writes. A kernel that read its input before that wait, or a wait left
out, would make the results depend on timing. The GPU test runs one fp8 decode layer's chain
of kernels (norm and quantization, fp8 matmuls with split K, rotary with the cache write, split
decode attention and its merge, the fused activation), each reading what the one before wrote,
eagerly and replayed in a CUDA graph, and asks for the same bits with PDL as without.
"""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import common


def test_pdl_only_on_cuda(monkeypatch):
    monkeypatch.delenv(common.PDL_ENV, raising=False)
    assert not common.use_pdl(torch.device("cpu"))


@pytest.mark.gpu
def test_pdl_follows_the_capability_and_the_switch(monkeypatch):
    dev = torch.device("cuda")
    monkeypatch.setenv(common.PDL_ENV, "1")
    assert common.use_pdl(dev) == (common.capability(dev) >= (9, 0))
    monkeypatch.setenv(common.PDL_ENV, "0")
    assert not common.use_pdl(dev)


def _weights(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=gen, device="cuda") / k**0.5
    return pk.quantize_fp8_per_token(w)


def _layer(hidden, res, w, caches, meta):
    """One decode layer of a Llama-like model (32 query heads, 8 KV heads of 128) on fp8
    weights and an fp8 cache, every op a kernel of this package."""
    k_cache, v_cache, k_scale, v_scale = caches
    positions, slots, tables, lens = meta
    t = hidden.shape[0]
    xq, xs, _ = pk.fused_add_rms_norm_fp8(hidden, res, w["norm"], 1e-5, residual_out=res)
    qkv = pk.fp8_matmul(xq, xs, *w["qkv"], fast_accum=True)
    q, k, v = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k, v = q.view(t, 32, 128), k.view(t, 8, 128), v.view(t, 8, 128)
    pk.rotary_embedding_and_cache(positions, q, k, v, w["inv_freq"], k_cache, v_cache, slots,
                                  k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    attn = pk.paged_decode_attention(q.contiguous(), k_cache, v_cache, tables, lens,
                                     max_seq_len=2048, k_scale=k_scale, v_scale=v_scale,
                                     num_splits=4)  # fmt: skip
    aq, a_s = pk.quantize_fp8_per_token(attn.view(t, -1))
    o = pk.fp8_matmul(aq, a_s, *w["o"])
    yq, ys, _ = pk.fused_add_rms_norm_fp8(o, res, w["norm"], 1e-5, residual_out=res)
    gate_up = pk.fp8_matmul(yq, ys, *w["gate_up"], fast_accum=True)
    hq, hs = pk.silu_and_mul_fp8(gate_up)
    return pk.fp8_matmul(hq, hs, *w["down"], fast_accum=True)


@pytest.mark.gpu
def test_pdl_changes_no_bit(monkeypatch, seed):
    dev = torch.device("cuda")
    if common.capability(dev) < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    gen = torch.Generator(device=dev).manual_seed(seed)
    t, hid, inter, block = 48, 4096, 14336, 16
    w = {"norm": torch.rand(hid, generator=gen, device=dev).to(torch.bfloat16) + 0.5,
         "qkv": _weights(gen, 48 * 128, hid), "o": _weights(gen, hid, 32 * 128),
         "gate_up": _weights(gen, 2 * inter, hid), "down": _weights(gen, hid, inter),
         "inv_freq": 500000.0 ** -(torch.arange(0, 128, 2, device=dev).float() / 128)}  # fmt: skip
    lens = torch.randint(1, 2048, (t,), generator=gen, device=dev, dtype=torch.int32)
    per_seq = 2048 // block
    tables = torch.randperm(t * per_seq, generator=gen, device=dev).view(t, per_seq).int()
    pos = (lens - 1).long()
    slots = tables.gather(1, (pos // block).view(-1, 1)).view(-1).long() * block + pos % block
    meta = (pos, slots, tables, lens)
    hidden0 = torch.randn(t, hid, generator=gen, device=dev).to(torch.bfloat16)
    res0 = torch.randn(t, hid, generator=gen, device=dev).to(torch.bfloat16)
    cache0 = torch.randn(t * per_seq, block, 8, 128, generator=gen, device=dev)
    cache0 = cache0.to(torch.float8_e4m3fn)
    scales = (torch.tensor([0.5], device=dev), torch.tensor([0.25], device=dev))

    def run(pdl: str, graph: bool) -> tuple[torch.Tensor, ...]:
        monkeypatch.setenv(common.PDL_ENV, pdl)
        state = [hidden0.clone(), res0.clone(), cache0.clone(), cache0.clone()]
        hidden, res, k_cache, v_cache = state
        caches = (k_cache, v_cache, *scales)
        if not graph:
            out = _layer(hidden, res, w, caches, meta)
        else:
            # an eager pass first compiles every kernel (the capture must not)
            _layer(*[x.clone() for x in state[:2]], w, (*[x.clone() for x in state[2:]], *scales),
                   meta)  # fmt: skip
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = _layer(hidden, res, w, caches, meta)
            for _ in range(3):  # each replay from the same starting state
                for dst, src in zip(state, (hidden0, res0, cache0, cache0)):
                    dst.copy_(src)
                g.replay()
        torch.cuda.synchronize()
        return out.clone(), res.clone(), k_cache.clone(), v_cache.clone()

    want = run("0", graph=False)
    for pdl, graph in (("1", False), ("0", True), ("1", True)):
        got = run(pdl, graph)
        for name, a, b in zip(("output", "residual", "key cache", "value cache"), got, want):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), (
                f"PAGEDATTN_PDL={pdl} graph={graph}: {name} "
                f"differs (seed={seed})")  # fmt: skip
