"""Structured output on the embedded model (CPU): every output of a JSON schema validates with
`jsonschema`, regex outputs `re.fullmatch`, choices are one of the choices, grammars (Lark and
GBNF) hold; unconstrained requests of a mixed batch get the tokens they get alone; matcher
state survives forks and preemption."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.structured import StructuredOutputsParams as SO
from pagedkv.engine.structured.bitmask import full_bitmask, unpack_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
}
PROMPTS = ["Describe a user of the system as JSON:", "Here is a JSON record of a person:",
           "Output one user profile."]


@pytest.fixture(scope="module")
def make_engine(embedded_model) -> Callable[..., LLMEngine]:
    def make(**overrides: Any) -> LLMEngine:
        opts: dict[str, Any] = dict(device="cpu", kv_cache_gb=0.05, swap_space=0.02, seed=0)
        opts.update(overrides)
        return LLMEngine(EngineArgs(**opts), model=embedded_model)

    return make


@pytest.fixture(scope="module")
def engine(make_engine) -> LLMEngine:
    return make_engine()


@pytest.fixture(autouse=True, scope="module")
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def run_all(engine: LLMEngine, prompts, params) -> list:
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = []
    for p, sp in zip(prompts, params):
        rid = f"r{engine.get_num_unfinished_requests()}-{len(ids)}-{id(sp)}"
        engine.add_request(rid, p, sp)
        ids.append(rid)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.get_stats().gpu_kv_usage == 0.0, "KV blocks leaked"
    return [finals[r] for r in ids]


def texts(outs) -> list[str]:
    return [c.text for o in outs for c in o.outputs]


def test_json_schema_outputs_validate(engine):
    greedy = SamplingParams(temperature=0, max_tokens=90, structured_outputs=SO(json=SCHEMA))
    sampled = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=90,
                             structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True))
    outs = run_all(engine, PROMPTS[:2] + PROMPTS[2:], [greedy] * 2 + [sampled])
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert set(json.loads(c.text)) == set(SCHEMA["properties"])  # strict: no other keys
    compact = [c.text for c in outs[2].outputs]
    assert all(" " not in t.replace('" ', "").split('"')[0] for t in compact)
    assert all("\n" not in t for t in compact)


def test_json_object_and_strict_false(engine):
    outs = run_all(engine, ["Some JSON:"], SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=SO(json_object=True,
                                                            disable_any_whitespace=True)))
    c = outs[0].outputs[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)
    else:  # a long object: still a valid prefix of one
        assert c.text.startswith("{")


def test_regex_outputs_fullmatch(engine):
    patterns = [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{3,20}\.", r"[A-Z][a-z]+ [A-Z][a-z]+"]
    sp = [SamplingParams(temperature=t, seed=3, max_tokens=30, structured_outputs=SO(regex=p))
          for p in patterns for t in (0.0, 1.0)]
    outs = run_all(engine, ["Answer:"] * len(sp), sp)
    for o, p in zip(outs, [p for p in patterns for _ in (0, 1)]):
        assert re.fullmatch(p, o.outputs[0].text), (p, o.outputs[0].text)


def test_choice_outputs_are_one_of_the_choices(engine):
    choices = ["Paris", "London", "Berlin", "a city I do not know"]
    sp = [SamplingParams(temperature=0, max_tokens=12, structured_outputs=SO(choice=choices)),
          SamplingParams(temperature=1.5, n=4, seed=1, max_tokens=12,
                         structured_outputs=SO(choice=choices))]
    outs = run_all(engine, ["The capital of France is", "Pick a city:"], sp)
    assert outs[0].outputs[0].text == "Paris"
    for c in outs[1].outputs:
        assert c.text in choices and c.finish_reason == "stop"


@pytest.mark.parametrize(("grammar", "python_re"), [
    ('start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/', r"The answer is [0-9]{1,3}\."),
    ('root ::= ("yes" | "no") "!" [a-z]*', r"(yes|no)![a-z]*"),  # GBNF
])
def test_grammar_outputs_hold(engine, grammar, python_re):
    sp = SamplingParams(temperature=0, max_tokens=16, structured_outputs=SO(grammar=grammar))
    [t] = texts(run_all(engine, ["Q: How many legs has a spider? A:"], sp))
    assert re.fullmatch(python_re, t), t


def test_unconstrained_requests_of_a_mixed_batch_get_their_greedy_tokens(make_engine):
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    alone = [o.outputs[0].token_ids for o in run_all(make_engine(), prompts, plain)]
    constrained = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=SCHEMA)),
                   SamplingParams(temperature=0.7, seed=2, max_tokens=20,
                                  structured_outputs=SO(regex="[a-z ]+"))]
    mixed = run_all(make_engine(), [prompts[0], PROMPTS[0], prompts[1], "x", prompts[2]],
                    [plain, constrained[0], plain, constrained[1], plain])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMA)


PRESSURE_PROMPTS = [PROMPTS[0], "Say something:", "Once upon a time"]
PRESSURE_PARAMS = [
    SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=SCHEMA)),
    SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=24, ignore_eos=True,
                   structured_outputs=SO(regex=r"[a-z]+( [a-z]+)*\.")),
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
]


@pytest.fixture(scope="module")
def pressure_reference(make_engine) -> list[str]:
    return texts(run_all(make_engine(block_size=8), PRESSURE_PROMPTS, PRESSURE_PARAMS))


@pytest.mark.parametrize("overrides", [
    dict(num_gpu_blocks_override=10, preemption_mode="recompute"),
    dict(num_gpu_blocks_override=10, num_cpu_blocks_override=64, preemption_mode="swap"),
    dict(max_num_batched_tokens=8),
], ids=["recompute", "swap", "chunked-prefill"])
def test_constrained_outputs_identical_under_preemption(make_engine, pressure_reference,
                                                        overrides):
    engine = make_engine(block_size=8, **overrides)
    got = run_all(engine, PRESSURE_PROMPTS, PRESSURE_PARAMS)
    assert texts(got) == pressure_reference
    if "num_gpu_blocks_override" in overrides:
        assert engine.get_stats().num_preemptions > 0


# ---- the matcher state: forks copy it -----------------------------------------------------------


class _Group:
    pass


class _Seq:
    def __init__(self, seq_id, tokens, prompt_len, group):
        self.seq_id, self.token_ids, self.prompt_len, self.group = seq_id, tokens, prompt_len, group
        self.is_finished = False


def _allowed(req, seq, vocab):
    mask = full_bitmask(1, vocab)
    req.fill(req.matcher(seq), mask, 0)
    return unpack_bitmask(mask, vocab)[0]


def test_forked_matchers_equal_fresh_ones_advanced_by_the_same_tokens(engine):
    tok = engine.get_tokenizer()
    vocab = engine.model_config.vocab_size
    from pagedkv.engine.structured.matchers import GrammarBackend

    backend = GrammarBackend(tok, vocab, engine.eos_token_ids)
    params = SO(json=SCHEMA)
    req = backend.request(params)
    g = _Group()
    text_a = '{"name": "Ann", "age": 3'
    text_b = '{"name": "Bob'
    a = tok.encode(text_a, add_special_tokens=False)
    b = tok.encode(text_b, add_special_tokens=False)
    prompt = [1, 2, 3]
    parent = _Seq(0, prompt + a, 3, g)
    _allowed(req, parent, vocab)  # the parent is far ahead
    child = _Seq(1, prompt + b, 3, g)  # shares a prefix with the parent, then differs
    fresh = backend.request(params)
    assert torch.equal(_allowed(req, child, vocab), _allowed(fresh, _Seq(9, prompt + b, 3, g),
                                                             vocab))
    # The parent's state was not disturbed by the fork, and both advance independently.
    parent.token_ids += tok.encode("0,", add_special_tokens=False)
    ref = backend.request(params)
    assert torch.equal(_allowed(req, parent, vocab),
                       _allowed(ref, _Seq(8, list(parent.token_ids), 3, g), vocab))


def test_structured_output_needs_a_tokenizer_and_a_grammar_it_can_follow(make_engine):
    sp = SamplingParams(max_tokens=4, structured_outputs=SO(regex="[0-9]+"))
    no_tok = make_engine(skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="need a tokenizer"):
        no_tok.add_request("x", [1, 2, 3], sp)
    assert not no_tok.has_unfinished_requests()
