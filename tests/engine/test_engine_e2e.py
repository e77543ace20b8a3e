"""The whole engine (scheduler + runner + sampler) on the real embedded model, against
transformers and against itself under preemption, prefix caching and chunked prefill."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Translate to French: I like apples.",
    "Q: What is the largest planet in the solar system?\nA:",
    "Hi",
    "The three primary colors are red, yellow and blue. Mixing red and blue gives purple, mixing "
    "blue and yellow gives green, and mixing red and yellow gives",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def make_engine(embedded_model) -> Callable[..., LLMEngine]:
    """Engines over one loaded copy of the embedded model (float32, CPU)."""

    def make(**overrides: Any) -> LLMEngine:
        opts: dict[str, Any] = dict(device="cpu", kv_cache_gb=0.05, swap_space=0.02, seed=0)
        opts.update(overrides)
        return LLMEngine(EngineArgs(**opts), model=embedded_model)

    return make


def run_all(engine: LLMEngine, prompts, params) -> list:
    """Add every prompt, step to the end, return final outputs in order; checks no leak."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.gpu_kv_usage == 0.0 and stats.cpu_kv_usage == 0.0, "KV blocks leaked"
    return [finals[f"r{i}"] for i in range(len(prompts))]


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def baseline(make_engine) -> list[list[int]]:
    outs = run_all(make_engine(), PROMPTS, greedy(logprobs=1))
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_and_logprobs_match_transformers(
    make_engine, hf_embedded_model, embedded_tokenizer, hf_generate
):
    outs = run_all(make_engine(), PROMPTS, greedy(logprobs=2))
    prompt_ids = [o.prompt_token_ids for o in outs]
    assert prompt_ids == [embedded_tokenizer(p).input_ids for p in PROMPTS]
    assert len({len(p) for p in prompt_ids}) >= 6, "prompts of different lengths"
    ref = hf_generate(hf_embedded_model, prompt_ids, NEW_TOKENS)
    for out, ref_tokens, ref_logits in zip(outs, ref.tokens, ref.logits):
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens
        assert len(comp.logprobs) == NEW_TOKENS
        for pos, (lp, logits) in enumerate(zip(comp.logprobs, ref_logits)):
            ref_lp = torch.log_softmax(logits.double(), -1)
            tok = comp.token_ids[pos]
            assert lp[tok].rank == 1
            assert abs(lp[tok].logprob - ref_lp[tok].item()) < 1e-3
            assert len(lp) >= 2  # the sampled token and its top-2 alternatives
        assert math.isclose(
            comp.cumulative_logprob, sum(lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)),
            rel_tol=1e-6, abs_tol=1e-6,
        )
        assert comp.text == embedded_tokenizer.decode(comp.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "name, overrides, expect_preemption",
    [
        ("recompute", dict(num_gpu_blocks_override=9, preemption_mode="recompute"), True),
        ("swap", dict(num_gpu_blocks_override=9, num_cpu_blocks_override=64, preemption_mode="swap"), True),
        ("swap-falls-back", dict(num_gpu_blocks_override=9, num_cpu_blocks_override=1, preemption_mode="swap"), True),
        ("chunked-prefill", dict(max_num_batched_tokens=8), False),
        ("prefix-caching", dict(enable_prefix_caching=True), False),
        ("block-size-8", dict(block_size=8), False),
        ("block-size-128", dict(block_size=128), False),
    ],
)
def test_outputs_identical_under_memory_policies(make_engine, baseline, name, overrides, expect_preemption):
    engine = make_engine(**overrides)
    outs = run_all(engine, PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == baseline
    if expect_preemption:
        assert engine.get_stats().num_preemptions > 0, "the KV budget should force preemption"


def test_prefix_cache_hits_and_same_outputs(make_engine):
    system = ("You are a careful assistant. Answer briefly and precisely, and never invent facts. "
              "If you do not know, say so. ") * 2
    prompts = [system + q for q in ("What is 2+2?", "Name a color.", "Say hello.")]
    plain = run_all(make_engine(), prompts, greedy(12))
    engine = make_engine(enable_prefix_caching=True)
    cached = run_all(engine, prompts, greedy(12))
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    # Later requests found the system prompt's blocks in the cache.
    stats = engine.get_stats()
    assert stats.prefix_cache_hits >= 2 * (len(engine.get_tokenizer()(system).input_ids) // 16)


def test_parallel_sampling_and_swap_preemption_of_groups(make_engine):
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=20, ignore_eos=True)
    ref = run_all(make_engine(), ["Write a haiku about the sea."], params)[0]
    assert len(ref.outputs) == 3 and len({tuple(c.token_ids) for c in ref.outputs}) > 1
    # A KV budget that forces preemption of the group (swap: its blocks are shared).
    engine = make_engine(num_gpu_blocks_override=6, num_cpu_blocks_override=32)
    others = [greedy(20)] * 3
    outs = run_all(engine, ["Write a haiku about the sea.", "Count: one, two,", "Colors:", "Hi"],
                   [params, *others])
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in ref.outputs]
    assert engine.get_stats().num_preemptions > 0


def test_seeded_sampling_independent_of_batch(make_engine):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = run_all(make_engine(), ["The weather today is"], sp)[0].outputs[0].text
    mixed = run_all(
        make_engine(),
        ["Other prompt", "The weather today is", "Another one here"],
        [SamplingParams(temperature=1.0, max_tokens=10), sp, SamplingParams(temperature=0.5, seed=1, max_tokens=20)],
    )[1].outputs[0].text
    assert alone == mixed


def test_beam_search_matches_transformers(make_engine, hf_embedded_model, embedded_tokenizer):
    prompt = "The capital of France is"
    ours = run_all(make_engine(), [prompt],
                   SamplingParams(use_beam_search=True, best_of=4, temperature=0.0, max_tokens=12))[0]
    ids = torch.tensor([embedded_tokenizer(prompt).input_ids])
    with torch.inference_mode():
        ref = hf_embedded_model.generate(ids, num_beams=4, do_sample=False, max_new_tokens=12,
                                         early_stopping=False, length_penalty=1.0)
    assert ours.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_stop_strings_and_stop_tokens(make_engine, baseline, embedded_tokenizer):
    full = embedded_tokenizer.decode(baseline[0])  # continuation of "The capital of France is"
    stop = full.strip()[:4]
    out = run_all(make_engine(), [PROMPTS[0]], greedy(stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.startswith(out.text)
    tok = baseline[0][3]
    out = run_all(make_engine(), [PROMPTS[0]], greedy(stop_token_ids=[tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok and out.token_ids[-1] == tok


def test_bad_inputs_raise_and_engine_keeps_serving(make_engine, baseline):
    engine = make_engine(max_model_len=64)
    bad = [
        ("", SamplingParams()),
        ([], SamplingParams()),
        ("x " * 200, SamplingParams()),  # longer than max_model_len
        ([10**9], SamplingParams()),  # token id outside the vocabulary
        ("ok", "not params"),
    ]
    for prompt, sp in bad:
        with pytest.raises(ValueError):
            engine.add_request("bad", prompt, sp)
        assert not engine.has_unfinished_requests()
    for kwargs in (dict(max_tokens=0), dict(n=3, best_of=2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    out = run_all(engine, [PROMPTS[0]], greedy(8))[0]
    assert out.outputs[0].token_ids == baseline[0][:8]


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        LLMEngine(EngineArgs(model=str(tmp_path / "nope"), device="cpu"))


def test_abort_frees_blocks_in_every_state(make_engine):
    engine = make_engine(num_gpu_blocks_override=8, num_cpu_blocks_override=32, max_num_batched_tokens=16)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"a{i}", p, greedy(40))
    for _ in range(6):
        engine.step()
    for i in range(len(PROMPTS)):
        engine.abort_request(f"a{i}")
    finals = [o for o in engine.step() if o.finished]
    assert len(finals) == len(PROMPTS)
    assert all(c.finish_reason == "abort" for o in finals for c in o.outputs)
    stats = engine.get_stats()
    assert stats.gpu_kv_usage == 0.0 and stats.cpu_kv_usage == 0.0
    assert not engine.has_unfinished_requests()


def test_a_failing_step_aborts_its_batch_and_the_engine_goes_on(make_engine, baseline, monkeypatch):
    engine = make_engine()
    engine.add_request("doomed", PROMPTS[1], greedy(8))
    real = engine.runner.execute

    def broken(*args, **kwargs):
        monkeypatch.setattr(engine.runner, "execute", real)
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(engine.runner, "execute", broken)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finals] == [("doomed", "abort")]
    assert engine.get_stats().gpu_kv_usage == 0.0
    out = run_all(engine, [PROMPTS[0]], greedy(8))[0]
    assert out.outputs[0].token_ids == baseline[0][:8]
