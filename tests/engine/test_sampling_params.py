"""SamplingParams: vLLM defaults and derived values; every bad value gets a ValueError naming it."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams, SamplingType

BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"n": 0}, "n must"),
    ({"n": 3, "best_of": 2, "temperature": 1.0}, "n must be <= best_of"),
    ({"best_of": 0}, "best_of"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"repetition_penalty": 1000.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens must be <= max_tokens"),
    ({"stop": ""}, "stop strings"),
    ({"stop": ["ok", ""]}, "stop strings"),
    ({"stop": [3]}, "stop strings"),
    ({"stop": 3}, "stop must"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"seed": 1.5}, "seed"),
    ({"use_beam_search": True, "best_of": 4, "temperature": 0.7}, "temperature must be 0"),
    ({"use_beam_search": True, "best_of": 4, "temperature": 0, "top_p": 0.9}, "top_p"),
    ({"use_beam_search": True, "best_of": 4, "temperature": 0, "stop": "x"}, "stop strings"),
    ({"length_penalty": 0.5}, "length_penalty only applies to beam search"),
    ({"early_stopping": True}, "early_stopping only applies to beam search"),
    (
        {"use_beam_search": True, "best_of": 2, "temperature": 0, "early_stopping": "x"},
        "early_stopping must be",
    ),
    ({"n": 2, "temperature": 0.0}, "greedy"),
    ({"stop": "x", "detokenize": False}, "detokenize"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[str(k) for k, _ in BAD])
def test_bad_values_raise_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_range_is_in_the_message():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2, 2\]"):
        SamplingParams(presence_penalty=9)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.use_beam_search
    assert p.sampling_type == SamplingType.RANDOM


def test_valid_edge_values_pass():
    SamplingParams(
        n=2,
        best_of=3,
        temperature=0.01,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        repetition_penalty=0.01,
        presence_penalty=-2,
        frequency_penalty=2,
        logprobs=20,
        prompt_logprobs=0,
        min_tokens=5,
        max_tokens=5,
        seed=-7,
        stop=["a", "bc"],
        stop_token_ids=[0, 5],
    )
    SamplingParams(top_k=1, top_p=1e-9, max_tokens=None, min_tokens=100)
    SamplingParams(
        use_beam_search=True,
        best_of=4,
        n=2,
        temperature=0,
        length_penalty=-1.5,
        early_stopping="never",
    )


def test_sampling_type_and_derived_values():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=5e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.5, seed=1).sampling_type == SamplingType.RANDOM_SEED
    beam = SamplingParams(use_beam_search=True, n=2, best_of=5, temperature=0)
    assert beam.sampling_type == SamplingType.BEAM and beam.beam_width == 5
    assert SamplingParams(use_beam_search=True, n=3, temperature=0).beam_width == 3
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["ab", "xyz"]).output_text_buffer_length == 2
    assert (
        SamplingParams(stop=["ab"], include_stop_str_in_output=True).output_text_buffer_length == 0
    )
    assert SamplingParams(stop_token_ids=[7]).all_stop_token_ids([2]) == {2, 7}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).all_stop_token_ids([2]) == {7}
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert not SamplingParams().needs_penalties


def test_caller_lists_are_not_mutated_or_shared():
    stop = ["a"]
    ids = [3]
    p = SamplingParams(stop=stop, stop_token_ids=ids)
    p.stop.append("b")
    p.stop_token_ids.append(4)
    assert stop == ["a"] and ids == [3]
    q = p.clone()
    q.stop.append("c")
    assert p.stop == ["a", "b"]


def test_outputs_are_plain_dataclasses_with_vllm_fields():
    lp = Logprob(-0.5, rank=1, decoded_token="hi")
    c = CompletionOutput(0, "hi", [5], -0.5, [{5: lp}], "stop", None)
    m = RequestMetrics(arrival_time=1.0, first_token_time=1.25, finished_time=2.0)
    r = RequestOutput("r0", "x", [1, 2], [c], True, m)
    assert r.outputs[0].finished() and r.metrics.ttft == 0.25 and r.metrics.e2e_latency == 1.0
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index",
        "text",
        "token_ids",
        "cumulative_logprob",
        "logprobs",
        "finish_reason",
        "stop_reason",
    ]
    assert [f.name for f in dataclasses.fields(RequestOutput)][:6] == [
        "request_id",
        "prompt",
        "prompt_token_ids",
        "outputs",
        "finished",
        "metrics",
    ]
    assert dataclasses.asdict(lp) == {"logprob": -0.5, "rank": 1, "decoded_token": "hi"}
