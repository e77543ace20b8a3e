"""Two micro-batches of a decode batch: the split of its rows and of its pending tokens, and
the threshold's check (the GPU test that split batches give the same tokens is in
`test_engine_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.worker.microbatch import microbatch_from_env, split_rows
from pagedkv.engine.worker.model_runner import PendingTokens


@pytest.mark.parametrize("n, first", [(2, 1), (3, 2), (512, 256), (1023, 512), (1024, 512)])
def test_the_first_half_takes_the_odd_row(n, first):
    assert split_rows(n) == first


def test_pending_tokens_split_renumbers_the_second_half():
    tokens = torch.tensor([10, 11, 12, 13])
    pending = PendingTokens([0, 2, 3, 5], [3, 2, 1, 0], tokens)
    a, b = pending.split(3)
    assert (a.rows, a.sources) == ([0, 2], [3, 2])
    assert (b.rows, b.sources) == ([0, 2], [1, 0])
    assert a.tokens is tokens and b.tokens is tokens
    # written into each half's inputs, they give what the whole batch's write gives
    whole = torch.zeros(6, dtype=torch.long)
    pending.write_into(whole)
    first, second = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    a.write_into(first)
    b.write_into(second)
    assert torch.equal(torch.cat((first, second)), whole)


def test_a_half_without_placeholders_is_none():
    pending = PendingTokens([4, 5], [0, 1], torch.tensor([7, 8]))
    assert pending.split(3)[0] is None
    assert pending.split(6)[1] is None


@pytest.mark.parametrize("value", ["-1", "1", "half", "2.5"])
def test_a_bad_threshold_is_a_clear_error(value, monkeypatch):
    var = "PAGEDKV_MICROBATCH_FROM"
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        microbatch_from_env(var)
    monkeypatch.setenv(var, "384")
    assert microbatch_from_env(var) == 384
    monkeypatch.delenv(var)
    assert microbatch_from_env(var) == 0

