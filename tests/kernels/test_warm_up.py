"""`warm_up_decode_attention`: every decode-kernel variant a call can pick, compiled ahead.

On the CPU: which configurations and split counts it covers (`decode_variants`, host code),
that the torch path and the interpreter compile nothing, and that bad inputs are refused with
nothing changed. On a GPU: after the warm-up, decode calls of any row count, context bound
(so any split count) and order, by a plan or not, compile nothing new.
"""

from __future__ import annotations

import pytest
import torch

import pagedattn_kernels as pk
from pagedattn_kernels.attention import triton_launch as tl_
from pagedattn_kernels.common import FP8_DTYPE
from pagedattn_kernels.testing import compiled_kernels

BF16 = torch.bfloat16


def test_variants_cover_every_configuration_the_launcher_picks():
    """Llama-3-8B heads, 1,024 rows, contexts of at most 2,048: on a 16-bit cache one tile
    shape; on an fp8 cache the wide, narrow, one-warp and long tiles without a plan, the wide
    and the planned one-warp ones by a plan; up to eight splits (2,048 / 256)."""
    alone, planned, most = tl_.decode_variants(128, BF16, BF16, 8, 1024, 2048)
    assert [tl_.compiled_as(c) for c in alone] == [tl_.compiled_as(tl_.decode_config(128, BF16))]
    assert most == 8
    alone, planned, most = tl_.decode_variants(128, BF16, FP8_DTYPE, 8, 1024, 2048)
    assert {tl_.compiled_as(c) for c in alone} == {tl_.compiled_as(c) for c in (
        tl_.decode_config(128, BF16, kv_dtype=FP8_DTYPE, num_pairs=8),
        tl_.FP8_NARROW, tl_.FP8_ONE_WARP, tl_.FP8_LONG)}  # fmt: skip
    assert len(alone) == 4
    by_plan = {tl_.compiled_as(c): n for c, n in planned}
    assert by_plan == {
        tl_.compiled_as(tl_.decode_config(128, BF16, kv_dtype=FP8_DTYPE, num_pairs=8,
                                       planned=True)): 1,
        tl_.compiled_as(tl_.FP8_PLANNED_ONE_WARP): tl_.FP8_PLANNED_ONE_WARP_PAIRS // 8,
    }  # fmt: skip
    # every configuration a call can take is among them, at any row count and bound
    for n in (1, 31, 32, 63, 64, 65, 300, 1024):
        for bound in (1, 200, 2048):
            cfg = tl_.decode_config(128, BF16, False, FP8_DTYPE, n * 8, context_bound=bound)
            assert tl_.compiled_as(cfg) in {tl_.compiled_as(c) for c in alone}, (n, bound)
    # the split counts a call can have stay within `most`
    for n in (1, 2, 8, 16):
        for bound in (300, 1000, 2048):
            assert tl_.choose_num_splits(n, 8, bound, 132, 8, None, 32) <= most
    assert tl_.decode_variants(128, BF16, BF16, 8, 4, 100)[2] == 1  # never split below 256


def _caches(dtype=BF16, device="cpu"):
    key = torch.zeros(4, 16, 2, 64, dtype=dtype, device=device)
    return key, torch.zeros_like(key)


def test_torch_path_and_interpreter_compile_nothing():
    key, value = _caches()
    kw = {"dtype": BF16, "max_num_seqs": 8, "max_seq_len": 64}
    assert pk.warm_up_decode_attention(4, key, value, **kw) == 0
    assert pk.warm_up_decode_attention(4, key, value, backend="triton", **kw) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_heads": 0}, "num_heads must be a positive int"),
        ({"num_heads": 3}, "must be a multiple of the caches' KV heads"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive int"),
        ({"max_seq_len": 2.5}, "max_seq_len must be a positive int"),
        ({"dtype": torch.int32}, "dtype must be float16, bfloat16 or float32"),
        ({"value": torch.zeros(4, 16, 2, 32)}, "must match in shape"),
        ({"k_scale": torch.ones(1)}, "scale"),
    ],
)
def test_bad_inputs_are_refused_and_change_nothing(change, message):
    key, value = _caches()
    before = key.clone()
    kw = {"num_heads": 4, "value": value, "dtype": BF16, "max_num_seqs": 8, "max_seq_len": 64}
    kw.update(change)
    num_heads, value = kw.pop("num_heads"), kw.pop("value")
    with pytest.raises(ValueError, match=message):
        pk.warm_up_decode_attention(num_heads, key, value, **kw)
    assert torch.equal(key, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype", [BF16, FP8_DTYPE], ids=["bf16", "fp8"])
def test_after_the_warm_up_no_decode_call_compiles(kv_dtype):
    """Decode calls of many row counts, bounds (so split counts), orders and by plans, as a
    server's mixed passes make them, compile nothing once the caches were warmed up."""
    heads, kv_heads, head_dim, block_size, max_len, max_seqs = 32, 8, 128, 16, 2048, 256
    key = torch.zeros(512, block_size, kv_heads, head_dim, dtype=kv_dtype, device="cuda")
    value = torch.zeros_like(key)
    scales = {}
    if kv_dtype == FP8_DTYPE:
        scales = {"k_scale": torch.ones(1, device="cuda"), "v_scale": torch.ones(1, device="cuda")}
    calls = pk.warm_up_decode_attention(heads, key, value, dtype=BF16, max_num_seqs=max_seqs,
                                        max_seq_len=max_len, **scales)  # fmt: skip
    assert calls > 0
    torch.cuda.synchronize()
    gen = torch.Generator(device="cpu").manual_seed(0)
    with compiled_kernels() as compiled:
        for n in (1, 3, 8, 20, 33, 64, 100, 200, 256):
            lens = torch.randint(1, max_len + 1, (n,), generator=gen, dtype=torch.int32)
            tables = torch.randint(0, 512, (n, max_len // block_size), generator=gen,
                                   dtype=torch.int32)  # fmt: skip
            q = torch.randn(n, heads, head_dim, dtype=BF16, device="cuda")
            lens_d, tables_d = lens.cuda(), tables.cuda()
            for bound in (int(lens.max()), 300, max_len):
                lens_b = lens_d.clamp(max=bound)
                order = torch.argsort(lens_b, descending=True).to(torch.int32)
                for seq_order in (None, order):
                    pk.paged_decode_attention(q, key, value, tables_d, lens_b, max_seq_len=bound,
                                              seq_order=seq_order, **scales)  # fmt: skip
            plan = pk.plan_decode(lens, num_kv_heads=kv_heads, head_dim=head_dim, dtype=BF16,
                                  kv_dtype=kv_dtype, device="cuda").to("cuda")  # fmt: skip
            pk.paged_decode_attention(q, key, value, tables_d, lens_d, max_seq_len=max_len,
                                      plan=plan, **scales)  # fmt: skip
        torch.cuda.synchronize()
    assert compiled == [], f"compiled after the warm-up: {compiled}"
