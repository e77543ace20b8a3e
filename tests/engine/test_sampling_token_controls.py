"""Token-level controls of SamplingParams against independent references: the batched token
bitmask, allowed_token_ids, bad_words (vLLM's rule), logit_bias, and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.sampling_params import RequestSampling, SamplingParams
from pagedkv.engine.structured.bitmask import (
    allow_only_tokens,
    apply_token_bitmask,
    ban_tokens,
    full_bitmask,
    tokens_to_bitmask,
    unpack_bitmask,
)
from pagedkv.engine.worker.sampler import Sampler, SamplingBatch, SamplingRow
from pagedkv.engine.worker.token_masks import TokenMasks, banned_by_bad_words

V = 100  # not a multiple of 32: the last word is partly used


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


# ---- the bitmask --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, V - 1), min_size=1), st.sets(st.integers(0, V - 1)))
def test_bitmask_rows_hold_exactly_the_allowed_tokens(allowed, banned):
    row = tokens_to_bitmask(sorted(allowed), V)
    assert row.dtype == torch.int32 and row.shape == ((V + 31) // 32,)
    assert set(unpack_bitmask(row[None], V)[0].nonzero().flatten().tolist()) == allowed
    ban_tokens(row, banned)
    assert set(unpack_bitmask(row[None], V)[0].nonzero().flatten().tolist()) == allowed - banned
    allow_only_tokens(row, sorted(banned))
    assert set(unpack_bitmask(row[None], V)[0].nonzero().flatten().tolist()) == banned


def test_bit_31_of_a_word_is_a_token_like_the_others():
    ids = [31, 63, 95, 0, 32]
    assert unpack_bitmask(tokens_to_bitmask(ids, V)[None], V)[0].nonzero().flatten().tolist() == \
        sorted(ids)


def test_apply_masks_exactly_the_disallowed_tokens_and_leaves_full_rows_alone():
    logits = _logits(3)
    before = logits.clone()
    mask = full_bitmask(3, V)
    mask[1] = tokens_to_bitmask([5, 31, 99], V)
    apply_token_bitmask(logits, mask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = logits[1] > -math.inf
    assert kept.nonzero().flatten().tolist() == [5, 31, 99]
    assert torch.equal(logits[1][kept], before[1][[5, 31, 99]])
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask(logits, mask[:2])


# ---- bad words: vLLM's rule ---------------------------------------------------------------------


def ref_bad_words(bad_words, output):
    """vLLM's `_apply_bad_words_single_batch`, written out: the banned last tokens."""
    banned = set()
    for word in bad_words:
        if len(word) > len(output) + 1:
            continue
        prefix_length = len(word) - 1
        actual = output[-prefix_length:] if prefix_length > 0 else []
        if list(actual) == list(word[:prefix_length]):
            banned.add(word[-1])
    return banned


@dataclass
class _Seq:
    token_ids: list[int]
    prompt_len: int
    seq_id: int = 0
    group: object = field(default=None, repr=False)
    is_finished: bool = False


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), max_size=4),
    st.lists(st.integers(0, 4), max_size=6),
    st.lists(st.integers(0, 4), min_size=1, max_size=3),
)
def test_bad_words_ban_what_vllm_bans(words, output, prompt):
    seq = _Seq(prompt + output, len(prompt))
    got = set(banned_by_bad_words([tuple(w) for w in words], seq))
    assert got == ref_bad_words(words, output)


# ---- the sampler with masks and biases ----------------------------------------------------------


def _sample(logits, rows, **kw):
    batch = SamplingBatch(rows, vocab_size=logits.shape[1], **kw)
    return Sampler()(logits.clone(), batch)


def test_allowed_token_mask_greedy_is_the_argmax_inside_the_set_and_sampling_stays_inside():
    allowed = [3, 17, 40, 41, 96]
    logits = _logits(4, seed=1)
    mask = full_bitmask(4, V)
    mask[0] = mask[2] = tokens_to_bitmask(allowed, V)
    rows = [SamplingRow(SamplingParams(temperature=0), [1], []),
            SamplingRow(SamplingParams(temperature=0), [1], []),
            SamplingRow(SamplingParams(temperature=1.5, seed=3), [1], [], num_samples=16),
            SamplingRow(SamplingParams(temperature=0), [1], [])]
    out = _sample(logits, rows, token_bitmask=mask)
    assert out.rows[0].token_ids == [max(allowed, key=lambda t: logits[0, t].item())]
    assert out.rows[1].token_ids == [int(logits[1].argmax())]  # unmasked rows untouched
    assert set(out.rows[2].token_ids) <= set(allowed) and len(set(out.rows[2].token_ids)) > 1
    assert out.rows[3].token_ids == [int(logits[3].argmax())]


def test_logit_bias_is_added_before_everything_else():
    logits = _logits(2, seed=2)
    bias = {7: 100.0, 8: -100.0, 9: 2.5}
    p = SamplingParams(temperature=0, logit_bias=bias)
    out = _sample(logits, [SamplingRow(p, [1], []), SamplingRow(SamplingParams(temperature=0), [1], [])])
    assert out.rows[0].token_ids == [7]
    assert out.rows[1].token_ids == [int(logits[1].argmax())]
    # Against the reference: the bias is added first, then the repetition penalty divides the
    # (now positive) logit of the seen token: the order decides which token wins.
    t_low = int(logits[0].argmin())
    top = logits[0].max().item()
    bias_val = top - logits[0, t_low].item() + 1.0  # biased token leads by 1.0 before penalty
    pen = SamplingParams(temperature=0, logit_bias={t_low: bias_val}, repetition_penalty=100.0)
    ref = logits[0].clone()
    ref[t_low] += bias_val
    ref[t_low] = ref[t_low] / 100.0 if ref[t_low] > 0 else ref[t_low] * 100.0
    got = _sample(logits[:1], [SamplingRow(pen, [t_low], [])]).rows[0].token_ids
    assert got == [int(ref.argmax())] and got != [t_low]
    # Logprobs stay those of the raw distribution (vLLM's default).
    lp = SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=1)
    r = _sample(logits[:1], [SamplingRow(lp, [1], [])]).rows[0]
    assert r.token_ids == [7]
    assert abs(r.logprobs[0].logprob - torch.log_softmax(logits[0], -1)[7].item()) < 1e-5


def test_bad_bias_and_mask_batches_raise():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingBatch([SamplingRow(SamplingParams(logit_bias={V: 1.0}), [], [])], vocab_size=V)
    with pytest.raises(ValueError, match="token_bitmask"):
        SamplingBatch([SamplingRow(SamplingParams(), [], [])], vocab_size=V,
                      token_bitmask=full_bitmask(2, V))


def test_token_masks_combine_allowed_ids_and_bad_words_per_row():
    class G:
        def __init__(self, sampling):
            self.sampling = sampling

    p = SamplingParams(temperature=0)
    allowed = RequestSampling.of(p, allowed_bitmask=tokens_to_bitmask([1, 2, 3, 4], V),
                                 bad_words_token_ids=((9, 3),))
    bad = RequestSampling.of(p, bad_words_token_ids=((5,), (7, 8)))
    plain = RequestSampling.of(p)
    assert not allowed.argmax_only and not bad.argmax_only and plain.argmax_only
    seqs = [_Seq([0, 9], 1, group=G(allowed)), _Seq([0, 7], 1, group=G(plain)),
            _Seq([0, 7], 1, group=G(bad)), _Seq([0, 6], 1, group=G(bad))]
    mask = TokenMasks(V, pin=False).build(seqs)
    rows = [set(r.nonzero().flatten().tolist()) for r in unpack_bitmask(mask, V)]
    assert rows[0] == {1, 2, 4}  # allowed ids minus "9 3"'s last token after a 9
    assert rows[1] == set(range(V))
    assert rows[2] == set(range(V)) - {5, 8}
    assert rows[3] == set(range(V)) - {5}
    assert TokenMasks(V, pin=False).build(seqs[1:2]) is None


def test_greedy_rows_under_masks_take_the_masked_argmax_without_a_sampling_batch(monkeypatch):
    """Structured output at temperature 0: the masked rows' argmax over what they allow, the
    other rows' plain argmax, as the sampler's general path gives, but no `SamplingBatch`."""
    from types import SimpleNamespace

    from pagedkv.engine.worker.sampling import BatchSampler

    p = SamplingParams(temperature=0)
    allowed = RequestSampling.of(p, allowed_bitmask=tokens_to_bitmask([1, 2, 3, 4], V),
                                 bad_words_token_ids=((9, 3),))
    bad = RequestSampling.of(p, bad_words_token_ids=((5,), (7, 8)))
    plain = RequestSampling.of(p)
    assert allowed.masked_argmax and bad.masked_argmax and not plain.masked_argmax
    assert not RequestSampling.of(SamplingParams(temperature=0.5), bad_words_token_ids=((5,),)
                                  ).masked_argmax

    def seq(tokens, rs, i):
        group = SimpleNamespace(sampling=rs, prompt_token_ids=tokens[:1])
        return SimpleNamespace(token_ids=tokens, prompt_len=1, seq_id=i, index=0, group=group,
                               num_output_tokens=len(tokens) - 1, is_finished=False)

    seqs = [seq([0, 9], allowed, 0), seq([0, 7], plain, 1), seq([0, 7], bad, 2),
            seq([0, 6], bad, 3), seq([0, 1], plain, 4)]
    may = [{1, 2, 4}, set(range(V)), set(range(V)) - {5, 8}, set(range(V)) - {5}, set(range(V))]
    for trial in range(5):
        logits = _logits(len(seqs), seed=trial)
        logits[:, [3, 5, 8, 50]] += 20.0  # the banned tokens (and one outside the allowed) lead
        expected = [max(sorted(m), key=lambda t, r=r: logits[r, t].item())
                    for r, m in enumerate(may)]
        sampler = BatchSampler(torch.device("cpu"), [0], seed=0, vocab_size=V)
        with monkeypatch.context() as m:
            m.setattr(SamplingBatch, "__init__", lambda *a, **k: pytest.fail("a sampling batch"))
            got = sampler.sample(seqs, [2] * len(seqs), logits.clone())
        assert [got.sampled_token_ids[i] for i in range(len(seqs))] == [[t] for t in expected]
        # The general path (one row asks for logprobs, so the batch needs the sampler) agrees.
        lp = RequestSampling.of(SamplingParams(temperature=0, logprobs=1))
        mixed = [*seqs, seq([0, 2], lp, 5)]
        general = sampler.sample(mixed, [2] * len(mixed), torch.cat([logits, _logits(1)]))
        assert [general.sampled_token_ids[i] for i in range(len(seqs))] == \
            [[t] for t in expected]


# ---- validation ---------------------------------------------------------------------------------

BAD = [
    ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys"),
    ({"logit_bias": {5: 101.0}}, "logit_bias values"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
    ({"logit_bias": {5: True}}, "logit_bias values"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": 3}, "allowed_token_ids"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["ok", " "]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
    ({"structured_outputs": "json"}, "structured_outputs must be"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(a"}}, "bad regex"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "bad json"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "bad grammar"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "choice"),
    ({"structured_outputs": {"choice": "a"}}, "choice"),
    ({"structured_outputs": {}}, "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD, ids=[str(k) for k, _ in BAD])
def test_bad_values_raise_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_values_are_copied_and_guided_decoding_is_an_alias():
    from pagedkv.engine.structured import GuidedDecodingParams, StructuredOutputsParams

    bias = {3: 1.5}
    allowed = [1, 2]
    p = SamplingParams(logit_bias=bias, allowed_token_ids=allowed, bad_words=["x"],
                       truncate_prompt_tokens=-1, logprobs=-1, prompt_logprobs=-1)
    assert p.logit_bias == bias and p.logit_bias is not bias and p.allowed_token_ids is not allowed
    g = GuidedDecodingParams(choice=["yes", "no"])
    q = SamplingParams(guided_decoding=g)
    assert q.structured_outputs is g and isinstance(g, StructuredOutputsParams)
    assert SamplingParams(structured_outputs={"regex": "[ab]+"}).structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=g, guided_decoding=GuidedDecodingParams(regex="a"))
    assert not RequestSampling.of(SamplingParams(temperature=0, prompt_logprobs=0)).argmax_only
    assert not RequestSampling.of(SamplingParams(temperature=0, logit_bias={1: 1.0})).argmax_only
    assert RequestSampling.of(SamplingParams(temperature=0)).argmax_only


def test_strict_json_schemas_close_objects_that_list_properties():
    from pagedkv.engine.structured.params import _strict_schema

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object"}},
              "$defs": {"c": {"properties": {"x": {}}, "additionalProperties": True}}}
    strict = _strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]["b"]  # no properties: stays open
    assert strict["$defs"]["c"]["additionalProperties"] is True  # said explicitly: kept
    assert "additionalProperties" not in schema  # the caller's schema is not changed


@pytest.mark.gpu
def test_token_masks_and_logit_bias_on_cuda_match_the_cpu():
    """The bitmask travels from pinned host memory and is applied on the device: the same
    tokens as on the CPU."""
    logits = _logits(6, seed=5)
    mask = full_bitmask(6, V, pin=True)
    mask[1] = tokens_to_bitmask([2, 31, 64, 99], V)
    mask[4] = tokens_to_bitmask([7, 8], V)
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={3: 50.0} if i == 2 else None),
                        [1], []) for i in range(5)]
    rows.append(SamplingRow(SamplingParams(temperature=1.0, seed=9), [1], [], position=4))
    cpu = _sample(logits, rows, token_bitmask=mask.clone())
    gpu = _sample(logits.cuda(), rows, device="cuda", token_bitmask=mask)
    assert [r.token_ids for r in cpu.rows] == [r.token_ids for r in gpu.rows]
    assert cpu.rows[2].token_ids == [3] and cpu.rows[4].token_ids[0] in (7, 8)
