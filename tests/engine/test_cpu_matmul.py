"""The CPU's oneDNN linear layers (``pagedkv.engine.models.cpu_matmul``): the same products as
``F.linear`` up to float32 rounding, packed for every decoder linear layer and for the LM head,
never for an embedding that only embeds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.engine.config import ModelConfig
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.models import cpu_matmul
from pagedkv.engine.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="torch without oneDNN")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(1, 96), (37, 96), (3, 5, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_f_linear(dtype, tol, shape, bias):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen).to(dtype)
    w = torch.randn(80, 96, generator=gen).to(dtype)
    b = torch.randn(80, generator=gen).to(dtype) if bias else None
    got = cpu_matmul.packed_linear(x, cpu_matmul.pack(w), b)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < tol, err
    # A non-contiguous view of the same values gives the same.
    strided = torch.stack([x, x], dim=-1)[..., 0]
    assert not strided.is_contiguous()
    assert torch.equal(cpu_matmul.packed_linear(strided, cpu_matmul.pack(w), b), got)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (576, 4096)])
def test_rows_do_not_depend_on_the_batch(threads, k, n):
    """Each row comes out bit-identical alone and among any number of others (batch
    invariance: seeded sampling gives a request the same tokens whatever shares its batch)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(k + n)
        w = cpu_matmul.pack(torch.randn(n, k, generator=gen))
        x = torch.randn(130, k, generator=gen)
        everything = cpu_matmul.packed_linear(x, w)
        for rows in (1, 2, 7, 64, 65, 129):
            part = cpu_matmul.packed_linear(x[:rows], w)
            assert torch.equal(part, everything[:rows]), f"{rows} rows"
        assert torch.equal(cpu_matmul.packed_linear(x[77], w), everything[77])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name, tied", [("llama-gqa-tied", True), ("llama3-rope", False)])
def test_every_linear_layer_and_the_head_are_packed(tiny_checkpoint, name, tied):
    ckpt = tiny_checkpoint(name)
    model = load_model(ModelConfig.from_model(str(ckpt.folder), device="cpu"), device="cpu",
                       dtype=torch.float32)  # fmt: skip
    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    embed = [m for m in model.modules() if type(m) is VocabParallelEmbedding]
    assert len(embed) == 1
    head = model.lm_head
    if tied:
        assert head is None and embed[0].packed_weight is not None
    else:
        assert head.packed_weight is not None and embed[0].packed_weight is None
    # The packed model's logits are the unpacked model's, up to float32 rounding.
    hidden = torch.randn(16, embed[0].embedding_dim)
    logits = model.compute_logits(hidden)
    for m in model.modules():
        if hasattr(m, "packed_weight"):
            m.packed_weight = None
    plain = model.compute_logits(hidden)
    assert float((logits - plain).norm() / plain.norm()) < 1e-5
