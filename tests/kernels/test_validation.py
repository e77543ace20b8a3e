"""Bad inputs get a ValueError that says what is wrong, and change nothing."""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels import resolve_backend
from pagedattn_kernels.testing import random_paged_batch, rejected_unchanged


@pytest.fixture
def caches():
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(4, 8, 2, 64, generator=gen)
    vc = torch.randn(4, 8, 2, 64, generator=gen)
    return kc, vc


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_reshape_and_cache_rejects(caches, backend):
    kc, vc = caches
    key = torch.randn(3, 2, 64)
    good_slots = torch.tensor([0, 5, -1])

    def call(k=key, v=key, kc_=kc, vc_=vc, slots=good_slots):
        return lambda: pk.reshape_and_cache(k, v, kc_, vc_, slots, backend=backend)

    assert "slot_mapping holds" in rejected_unchanged(call(slots=torch.tensor([0, 32, 1])), kc, vc)
    assert "slot_mapping holds" in rejected_unchanged(call(slots=torch.tensor([0, -2, 1])), kc, vc)
    assert "int32 or int64" in rejected_unchanged(call(slots=good_slots.float()), kc, vc)
    assert "shape" in rejected_unchanged(call(slots=good_slots[:2]), kc, vc)
    assert "kv heads" in rejected_unchanged(call(k=torch.randn(3, 1, 64), v=torch.randn(3, 1, 64)), kc, vc)
    assert "differ in shape" in rejected_unchanged(call(v=torch.randn(4, 2, 64)), kc, vc)
    assert "must match" in rejected_unchanged(call(vc_=vc.half()), kc, vc)
    assert "float32" in rejected_unchanged(call(k=key.long(), v=key.long()), kc, vc)


def test_attention_rejects():
    gen = torch.Generator().manual_seed(1)
    b = random_paged_batch(gen, [10, 20], [3, 1], num_heads=4, num_kv_heads=2, head_dim=64,
                           block_size=8, dtype=torch.float32)  # fmt: skip
    args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.cu_query_lens)
    out = torch.zeros_like(b.query)

    def call(*a, **kw):
        return lambda: pk.paged_attention(*a, out=out, **kw)

    q3 = torch.randn(4, 3, 64)
    assert "multiple of num_kv_heads" in rejected_unchanged(call(q3, *args[1:]), out)
    assert "head dim" in rejected_unchanged(call(torch.randn(4, 4, 32), *args[1:]), out)
    assert "caches are" in rejected_unchanged(call(b.query.half(), *args[1:]), out)
    bad_cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert "end at the 4 query rows" in rejected_unchanged(call(*args[:5], bad_cu), out)
    short = torch.tensor([2, 20], dtype=torch.int32)
    assert "seq_lens 2 < its 3" in rejected_unchanged(call(*args[:4], short, args[5]), out)
    long = torch.tensor([10, 50], dtype=torch.int32)
    assert "block_tables has" in rejected_unchanged(call(*args[:4], long, args[5]), out)
    tables = b.block_tables.clone()
    tables[0, 0] = 99
    assert "points at blocks" in rejected_unchanged(call(*args[:3], tables, *args[4:]), out)
    assert "max_seq_len hint" in rejected_unchanged(call(*args, max_seq_len=15), out)
    assert "scale" in rejected_unchanged(call(*args, scale=float("nan")), out)
    assert "cu_query_lens" in rejected_unchanged(call(*args[:5], b.cu_query_lens[:2]), out)
    with pytest.raises(ValueError, match="out must have"):
        pk.paged_attention(*args, out=torch.zeros(3, 4, 64))
    with pytest.raises(ValueError, match="backend="):
        pk.paged_attention(*args, backend="cuda")
    with pytest.raises(ValueError, match="num_splits"):
        pk.paged_decode_attention(b.query[:2], *args[1:5], num_splits=0)
    dec_out = torch.full_like(b.query[:2], 7.0)
    for order, match in ((torch.tensor([0, 0], dtype=torch.int32), "permutation"),
                         (torch.tensor([1, 2], dtype=torch.int32), "permutation"),
                         (torch.tensor([1, 0]), "1-D int32"),
                         (torch.tensor([0], dtype=torch.int32), "the 2 rows")):  # fmt: skip
        def call(order=order):
            return pk.paged_decode_attention(b.query[:2], *args[1:5], out=dec_out, seq_order=order)

        assert match in rejected_unchanged(call, dec_out)
    with pytest.raises(ValueError, match="rows but there are 2 sequences"):
        pk.paged_decode_attention(b.query, *args[1:5])


def test_block_ops_reject():
    kv = torch.randn(2, 5, 4, 2, 8)
    before = kv.clone()
    with pytest.raises(ValueError, match="destination block ids"):
        pk.copy_blocks(kv, torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="shape"):
        pk.copy_blocks(kv, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="num_blocks, block_size"):
        pk.copy_blocks(kv[0, 0], torch.tensor([[0, 1]]))
    dst = torch.zeros(2, 3, 4, 2, 8)
    with pytest.raises(ValueError, match="destination block ids"):
        pk.swap_blocks(kv, dst, torch.tensor([[0, 3]]))
    with pytest.raises(ValueError, match="match in every dim"):
        pk.swap_blocks(kv, torch.zeros(2, 3, 4, 2, 4), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="dst_cache is"):
        pk.swap_blocks(kv, dst.half(), torch.tensor([[0, 1]]))
    assert torch.equal(kv, before) and not dst.any()


def test_backend_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("PAGEDATTN_BACKEND", raising=False)
    assert resolve_backend(cpu, None) == "torch"
    assert resolve_backend(cuda, None) == "triton"
    assert resolve_backend(cuda, "torch") == "torch"
    assert resolve_backend(cpu, "triton") == "triton"
    monkeypatch.setenv("PAGEDATTN_BACKEND", "triton")
    assert resolve_backend(cpu, None) == "triton"
    assert resolve_backend(cpu, "auto") == "torch"  # the keyword wins
    monkeypatch.setenv("PAGEDATTN_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"\$PAGEDATTN_BACKEND='fast'"):
        resolve_backend(cpu, None)
    with pytest.raises(ValueError, match="CUDA tensors"):
        resolve_backend(torch.device("meta"), "triton")


def test_env_var_routes_cpu_tensors_to_the_interpreter(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    b = random_paged_batch(gen, [9], [1], num_heads=2, num_kv_heads=1, head_dim=64,
                           block_size=8, dtype=torch.float32)  # fmt: skip
    args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens)
    monkeypatch.setenv("PAGEDATTN_BACKEND", "triton")
    from pagedattn_kernels.attention import triton_launch

    calls = []
    real = triton_launch.paged_decode_attention
    monkeypatch.setattr(
        triton_launch, "paged_decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    out = pk.paged_decode_attention(*args)
    assert calls and torch.allclose(out, pk.paged_decode_attention(*args, backend="torch"),
                                    atol=1e-5)  # fmt: skip
