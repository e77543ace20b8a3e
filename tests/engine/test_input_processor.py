"""`InputProcessor`'s prompt token ids: plain ints in the vocabulary pass (checked in C for long
prompts), anything else is a clear error naming the first bad id."""

from __future__ import annotations

import pytest

from pagedkv.engine.input_processor import InputProcessor
from pagedkv.engine.sampling_params import SamplingParams


def _inputs() -> InputProcessor:
    return InputProcessor(None, vocab_size=100, max_model_len=8192, kv_capacity=1 << 20,
                          max_num_seqs=8)  # fmt: skip


@pytest.mark.parametrize("prompt", [[0, 99, 5], (7,), [3] * 5000, range(10, 60)])
def test_token_ids_in_the_vocabulary_pass(prompt):
    prepared = _inputs().prepare(prompt, SamplingParams(max_tokens=2))
    assert list(prepared.prompt_token_ids) == list(prompt)


@pytest.mark.parametrize("bad, named", [
    ([1, 2, 100], "100"), ([1, -1, 2], "-1"), ([1, True], "True"), ([1, 2.0], "2.0"),
    ([4] * 3000 + [100] + [101], "100"), ([1, "2"], "'2'"),
])  # fmt: skip
def test_a_bad_token_id_is_named(bad, named):
    with pytest.raises(ValueError, match=f"prompt token id {named} is not an int in \\[0, 100\\)"):
        _inputs().prepare(bad, SamplingParams(max_tokens=2))
