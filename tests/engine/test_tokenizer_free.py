"""Running on token ids alone: bundled shape-only configs (the benchmarks' Llama-3-8B, -70B and
OPT-13B with random weights) and `skip_tokenizer_init`."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.config import ModelConfig, bundled_config_names
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.model_loader import load_model
from pagedkv.engine.sampling_params import SamplingParams

# Published parameter counts (model cards) of the two Llama 3 shapes.
PUBLISHED_PARAMS = {
    "meta-llama/Meta-Llama-3-8B": 8_030_261_248,
    "meta-llama/Meta-Llama-3-70B": 70_553_706_496,
}


@pytest.mark.parametrize("name", ["meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-70B",
                                  "facebook/opt-13b"])
def test_bundled_shapes_match_transformers_and_model_cards(name: str) -> None:
    from transformers import AutoModelForCausalLM

    assert name in bundled_config_names()
    cfg = ModelConfig.from_model(name, load_format="dummy", dtype="bfloat16", device="cpu")
    assert cfg.name == name and cfg.is_bundled_shape
    ours = sum(p.numel() for p in load_model(cfg, load_format="dummy", device="meta").parameters())
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(cfg.hf_config)
    assert ours == sum(p.numel() for p in theirs.parameters())
    if name in PUBLISHED_PARAMS:
        assert ours == PUBLISHED_PARAMS[name]


def test_bundled_shape_needs_dummy_weights() -> None:
    with pytest.raises(ValueError, match="load-format dummy"):
        ModelConfig.from_model("meta-llama/Meta-Llama-3-8B", device="cpu")
    with pytest.raises(ValueError, match="shapes for --load-format dummy: facebook/opt-13b"):
        ModelConfig.from_model("no-such/model", load_format="dummy", device="cpu")
    cfg = ModelConfig.from_model("facebook/opt-13b", load_format="dummy", device="cpu")
    with pytest.raises(ValueError, match="skip-tokenizer-init"):
        cfg.get_tokenizer()


@pytest.fixture(scope="module")
def engines(embedded_model):
    def make(**kw) -> LLMEngine:
        return LLMEngine(EngineArgs(device="cpu", kv_cache_gb=0.05, swap_space=0.02, **kw),
                         model=embedded_model)

    return make(), make(skip_tokenizer_init=True)


def _run(engine: LLMEngine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.get_stats().gpu_kv_usage == 0.0
    return [done[f"t{i}"].outputs[0] for i in range(len(prompts))]


def test_token_ids_in_token_ids_out_same_as_with_tokenizer(engines) -> None:
    with_tok, without = engines
    assert without.get_tokenizer() is None
    prompts = [list(with_tok.get_tokenizer()("The capital of France is").input_ids), [1, 2, 3, 4, 5]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = _run(with_tok, prompts, params)
    got = _run(without, prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    assert all(c.text == "" for c in got) and ref[0].text


def test_text_prompts_and_stop_strings_are_refused_without_tokenizer(engines) -> None:
    _, without = engines
    before = without.get_num_unfinished_requests()
    with pytest.raises(ValueError, match="list of token ids"):
        without.add_request("x", "hello", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="stop_token_ids"):
        without.add_request("y", [1, 2, 3], SamplingParams(max_tokens=4, stop=["."]))
    assert without.get_num_unfinished_requests() == before
    assert not without.has_unfinished_requests()
    # the refused ids are still free to use
    out = _run(without, [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].token_ids) >= 1
