"""prompt_logprobs on the embedded model against transformers' logits, the same under chunked
prefill, prefix caching and recompute; truncate_prompt_tokens; logprobs=-1 (every token)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is Paris, and the capital of Italy is",
           "def add(a, b):\n    return", "Hi"]


@pytest.fixture(scope="module")
def make_engine(embedded_model) -> Callable[..., LLMEngine]:
    def make(**overrides: Any) -> LLMEngine:
        opts: dict[str, Any] = dict(device="cpu", kv_cache_gb=0.05, swap_space=0.02, seed=0)
        opts.update(overrides)
        return LLMEngine(EngineArgs(**opts), model=embedded_model)

    return make


def run_all(engine: LLMEngine, prompts, params) -> list:
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(make_engine):
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    return run_all(make_engine(), PROMPTS, sp)


def test_prompt_logprobs_match_transformers(reference, hf_embedded_model):
    for out in reference:
        ids = out.prompt_token_ids
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        with torch.inference_mode():
            logits = hf_embedded_model(input_ids=torch.tensor([ids])).logits[0].double()
        ref = torch.log_softmax(logits, -1)
        for j in range(1, len(ids)):
            pos = plp[j]
            tok = ids[j]
            assert abs(pos[tok].logprob - ref[j - 1, tok].item()) < 1e-3
            assert pos[tok].rank == int((ref[j - 1] > ref[j - 1, tok]).sum()) + 1
            top = ref[j - 1].topk(3).indices.tolist()
            assert set(top) <= set(pos) and len(pos) <= 4
            for r, t in enumerate(top, start=1):
                assert pos[t].rank == r


@pytest.mark.parametrize("overrides", [
    dict(max_num_batched_tokens=5),
    dict(enable_prefix_caching=True),
    dict(num_gpu_blocks_override=4, preemption_mode="recompute"),
], ids=["chunked-prefill", "prefix-caching", "recompute"])
def test_prompt_logprobs_identical_under_memory_policies(make_engine, reference, overrides):
    engine = make_engine(**overrides)
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    if overrides.get("enable_prefix_caching"):
        run_all(engine, PROMPTS, sp)  # the second run would find every prompt cached
    outs = run_all(engine, PROMPTS, sp)
    for got, ref in zip(outs, reference):
        assert len(got.prompt_logprobs) == len(ref.prompt_logprobs)
        for g, r in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert g.keys() == r.keys()
            assert all(abs(g[t].logprob - r[t].logprob) < 1e-4 and g[t].rank == r[t].rank
                       for t in g)
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_no_prompt_logprobs_unless_asked_and_zero_gives_the_token_only(make_engine):
    engine = make_engine()
    outs = run_all(engine, PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=2),
                                         SamplingParams(temperature=0, max_tokens=2,
                                                        prompt_logprobs=0)])
    assert outs[0].prompt_logprobs is None
    assert all(len(p) == 1 for p in outs[1].prompt_logprobs[1:])


def test_minus_one_means_every_token(make_engine):
    engine = make_engine()
    vocab = engine.model_config.vocab_size
    [out] = run_all(engine, ["Hello there"], SamplingParams(
        temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1))
    assert all(len(p) == vocab for p in out.prompt_logprobs[1:])
    assert all(len(p) == vocab for p in out.outputs[0].logprobs)
    probs = sum(torch.tensor([lp.logprob for lp in out.outputs[0].logprobs[0].values()]).exp())
    assert abs(probs.item() - 1.0) < 1e-3


def test_truncate_prompt_tokens_keeps_the_last_tokens(make_engine):
    engine = make_engine()
    tok = engine.get_tokenizer()
    full = tok(PROMPTS[0]).input_ids
    sp = SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=5)
    [cut] = run_all(engine, [PROMPTS[0]], sp)
    assert cut.prompt_token_ids == full[-5:]
    [direct] = run_all(make_engine(), [full[-5:]], SamplingParams(temperature=0, max_tokens=6))
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    [whole] = run_all(make_engine(), [PROMPTS[0]], SamplingParams(
        temperature=0, max_tokens=2, truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == full


def test_out_of_vocabulary_ids_and_bad_words_without_tokenizer_are_refused(make_engine):
    engine = make_engine()
    vocab = engine.model_config.vocab_size
    for sp, msg in [(SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                    (SamplingParams(allowed_token_ids=[0, vocab + 5]), "allowed_token_ids")]:
        with pytest.raises(ValueError, match=msg):
            engine.add_request("bad", "Hello", sp)
        assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="need a tokenizer"):
        make_engine(skip_tokenizer_init=True).add_request(
            "bw", [1, 2], SamplingParams(bad_words=["x"]))


def test_allowed_token_ids_bad_words_and_logit_bias_on_the_model(make_engine):
    engine = make_engine()
    tok = engine.get_tokenizer()
    base = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [plain] = run_all(engine, ["The capital of France is"], base)
    first = plain.outputs[0].token_ids[0]
    word = tok.decode([first]).strip()
    allowed = [first + 1, 28, 29, 30]
    outs = run_all(engine, ["The capital of France is"] * 3, [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={30: 100.0}),
    ])
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    assert word not in outs[1].outputs[0].text.split()
    assert outs[1].outputs[0].token_ids[0] != first
    assert outs[2].outputs[0].token_ids == [30] * 8
