"""Greedy tokens from logits in the model dtype (``compute_logits(hidden, float32=False)``,
``ModelRunner.greedy_tokens``): the same ids as the argmax of the float32 logits, ties included,
for every model family, with and without the CPU's packed LM head."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.config import ModelConfig
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.worker.model_runner import ModelRunner

from .conftest import TINY_MODELS


def _model(tiny_checkpoint, name: str, dtype: torch.dtype):
    ckpt = tiny_checkpoint(name)
    return load_model(ModelConfig.from_model(str(ckpt.folder), device="cpu"), device="cpu",
                      dtype=dtype)  # fmt: skip


def _hidden_size(model) -> int:
    head = model.lm_head if getattr(model, "lm_head", None) is not None else None
    if head is None:
        for name in ("embed_tokens", "wte"):
            if hasattr(model, name):
                head = getattr(model, name)
    return head.weight.shape[1]


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_dtype_logits_are_the_float32_ones_before_the_cast(tiny_checkpoint, name, dtype):
    model = _model(tiny_checkpoint, name, dtype)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(9, _hidden_size(model), generator=gen).to(dtype)
    wide = model.compute_logits(hidden)
    narrow = model.compute_logits(hidden, float32=False)
    assert wide.dtype == torch.float32 and narrow.dtype == dtype
    assert torch.equal(narrow.float(), wide)
    assert torch.equal(narrow.argmax(dim=-1), wide.argmax(dim=-1))


def test_greedy_tokens_break_ties_as_the_float32_argmax(tiny_checkpoint):
    """Two vocabulary rows made equal give equal logits: both argmaxes take the first."""
    model = _model(tiny_checkpoint, "llama3-rope", torch.bfloat16)
    head = model.lm_head
    head.packed_weight = None  # the CPU's packed copy would keep the old rows
    vocab = head.weight.shape[0]
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, head.weight.shape[1], generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        for row, tok in enumerate(model.compute_logits(hidden).argmax(dim=-1).tolist()):
            head.weight[(tok + vocab // 2 + row) % vocab] = head.weight[tok]  # a twin row
    wide = model.compute_logits(hidden)
    runner = ModelRunner.__new__(ModelRunner)  # greedy_tokens reads nothing but the model
    runner.model = model
    got = runner.greedy_tokens(hidden)
    assert got.dtype == torch.int64
    assert torch.equal(got, wide.argmax(dim=-1))
    tied = (wide == wide.max(dim=-1, keepdim=True).values).sum(dim=-1)
    assert bool((tied >= 2).all())  # the ties are real, and the first of each is taken
