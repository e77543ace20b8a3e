"""The API process's output processing (`pagedkv.engine.core.frontend`) on made-up step
messages: what a stream takes is what the offline detokenizer makes of the same tokens, a slow
stream gets one merged delta, a stop string ends the request here and asks the core to abort
it, and a request the core ends, refuses or loses ends its stream. No model, no process."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.core.frontend import FrontendOutputs
from pagedkv.engine.core.messages import (
    EngineCoreOutputs,
    EntryLogprobs,
    FinishedRequest,
    SeqFinish,
)
from pagedkv.engine.detokenizer import detokenize
from pagedkv.engine.input_processor import InputProcessor
from pagedkv.engine.sampling_params import SamplingParams

EOS = 0
ALPHABET = "\0abcdefgh .,!\n"  # token id i is the character ALPHABET[i]; 0 is EOS


class CharTokenizer:
    """One character per token (id 0 is the end of text)."""

    eos_token_id = EOS

    def __len__(self) -> int:
        return len(ALPHABET)

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[ALPHABET.index(c) for c in text])

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces=None):
        return "".join(ALPHABET[i] for i in ids if not (skip_special_tokens and i == EOS))


TOK = CharTokenizer()


def ids(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


def make(tokenizer=TOK) -> tuple[FrontendOutputs, InputProcessor]:
    inputs = InputProcessor(tokenizer, vocab_size=len(ALPHABET), max_model_len=64,
                            kv_capacity=1024, max_num_seqs=8)
    return FrontendOutputs(tokenizer, [EOS]), inputs


def add(outs: FrontendOutputs, inputs: InputProcessor, rid: str, params: SamplingParams,
        kind: str = "delta", prompt: str = "ab"):
    return outs.add(rid, inputs.prepare(prompt, params), kind, 0.0)


def step(rid: str, tokens: list[int], *, index: int = 0, finish: tuple | None = None,
         logprobs: list[float] | None = None, finished: list[FinishedRequest] = ()) -> EngineCoreOutputs:
    n = len(tokens)
    msg = EngineCoreOutputs(request_ids=[rid] * n, seq_indices=[index] * n, token_ids=tokens,
                            finished=list(finished))
    if finish is not None:
        msg.seq_finishes = [SeqFinish(n - 1, *finish)]
    if logprobs is not None:
        msg.logprobs = [EntryLogprobs(i, lp, 1, [], []) for i, lp in enumerate(logprobs)]
    return msg


def done(rid: str, aborted: bool = False, reasons=((0, "length", None),)) -> FinishedRequest:
    return FinishedRequest(rid, aborted, list(reasons), 0.0, 0.5, 0.75)


def run(coro):
    return asyncio.run(coro)


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET[1:], min_size=1, max_size=30),
    cuts=st.lists(st.integers(1, 30), max_size=6),
    stop=st.one_of(st.none(), st.text(alphabet="ab .", min_size=1, max_size=3)),
)
def test_deltas_join_to_what_the_offline_detokenizer_gives(text, cuts, stop) -> None:
    """However the steps are grouped between two takes, the joined deltas equal the offline
    `detokenize` of the same tokens (stop strings cut the same way), and a stop string ends
    the request here and asks the core to abort it."""

    async def go():
        outs, inputs = make()
        params = SamplingParams(max_tokens=len(text), temperature=0.0, stop=stop)
        st_ = add(outs, inputs, "r", params)
        toks = ids(text)
        pieces, token_ids, aborts = [], [], []
        bounds = sorted({min(c, len(toks)) for c in cuts} | {len(toks)})
        start = 0
        for b in bounds:
            chunk = toks[start:b]
            start = b
            last = b == len(toks)
            aborts += outs.process(step("r", chunk, finish=("length", None) if last else None,
                                        finished=[done("r")] if last else []))
            out = outs.take(st_)
            if out is None:
                continue
            for c in out.outputs:
                pieces.append(c.text)
                token_ids += c.token_ids
            if out.finished:
                break
        ref = detokenize(TOK, ids("ab"), toks, params, eos_token_ids=[EOS])
        assert "".join(pieces) == ref.text
        assert st_.finished and outs.take(st_) is None
        if isinstance(ref.stop_reason, str):
            assert out.outputs[-1].finish_reason == "stop"
            assert out.outputs[-1].stop_reason == ref.stop_reason
            # ended before the core's own finish: aborted there, unless it ended in the
            # last step, whose message carries the core's finish too
            stop_at = len(ref.output_token_ids) - 1
            last_chunk = stop_at >= bounds[-2] if len(bounds) > 1 else True
            assert aborts == ([] if last_chunk else ["r"])
        else:
            assert out.outputs[-1].finish_reason == "length" and aborts == []

    run(go())


def test_a_slow_stream_gets_one_merged_delta() -> None:
    async def go():
        outs, inputs = make()
        st_ = add(outs, inputs, "r", SamplingParams(max_tokens=10, temperature=0.0, logprobs=0))
        for tok, lp in zip(ids("abc"), (-0.5, -1.0, -0.25)):
            outs.process(step("r", [tok], logprobs=[lp]))
        assert st_.event.is_set()
        out = outs.take(st_)
        (c,) = out.outputs
        assert c.text == "abc" and c.token_ids == ids("abc") and not out.finished
        assert [list(p) for p in c.logprobs] == [[t] for t in ids("abc")]
        assert c.cumulative_logprob == pytest.approx(-1.75)
        assert outs.take(st_) is None  # nothing new
        outs.process(step("r", ids("d"), logprobs=[-1.0], finish=("length", None),
                          finished=[done("r")]))
        out = outs.take(st_)
        assert out.finished and out.outputs[0].text == "d" and out.outputs[0].token_ids == ids("d")
        assert out.outputs[0].finish_reason == "length"
        assert out.metrics.time_in_queue == pytest.approx(0.5)

    run(go())


def test_final_and_cumulative_kinds() -> None:
    async def go():
        outs, inputs = make()
        fin = add(outs, inputs, "f", SamplingParams(max_tokens=4, temperature=0.0), "final")
        cum = add(outs, inputs, "c", SamplingParams(max_tokens=4, temperature=0.0), "cumulative")
        for rid in ("f", "c"):
            outs.process(step(rid, ids("ab")))
        assert outs.take(fin) is None
        assert outs.take(cum).outputs[0].text == "ab"
        outs.process(step("c", ids("c")))
        assert outs.take(cum).outputs[0].text == "abc"  # everything so far
        for rid in ("f", "c"):
            outs.process(step(rid, ids("d"), finish=("length", None), finished=[done(rid)]))
        for s in (fin, cum):
            out = outs.take(s)
            assert out.finished and out.outputs[0].text in ("abd", "abcd")
            assert outs.take(s) is None

    run(go())


def test_aborted_request_ends_every_completion_with_abort() -> None:
    async def go():
        outs, inputs = make()
        st_ = add(outs, inputs, "r", SamplingParams(max_tokens=9, temperature=0.0))
        outs.process(step("r", ids("ab")))
        outs.process(EngineCoreOutputs(finished=[done("r", aborted=True, reasons=[(0, "abort",
                                                                                   None)])]))
        out = outs.take(st_)
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert out.outputs[0].text == "ab"

    run(go())


def test_best_of_keeps_the_n_most_likely() -> None:
    async def go():
        outs, inputs = make()
        params = SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=2)
        st_ = add(outs, inputs, "r", params, "final")
        # three sequences (the first token forks them), logprobs forced by best_of > n
        lps = {0: (-3.0, -3.0), 1: (-0.5, -0.5), 2: (-1.0, -2.0)}
        for pos in range(2):
            msg = EngineCoreOutputs(request_ids=["r"] * 3, seq_indices=[0, 1, 2],
                                    token_ids=ids("abc"), logprobs=[
                                        EntryLogprobs(i, lps[i][pos], 1, [], []) for i in range(3)])
            if pos == 1:
                msg.seq_finishes = [SeqFinish(i, "length") for i in range(3)]
                msg.finished = [done("r", reasons=[(0, "length", None)])]
            outs.process(msg)
        out = outs.take(st_)
        (c,) = out.outputs
        assert c.index == 0 and c.text == "bb" and c.cumulative_logprob == pytest.approx(-1.0)
        assert c.logprobs is None  # not asked for by the user

    run(go())


def test_refused_or_lost_requests_end_their_streams() -> None:
    async def go():
        outs, inputs = make()
        a = add(outs, inputs, "a", SamplingParams(max_tokens=4))
        b = add(outs, inputs, "b", SamplingParams(max_tokens=4))
        outs.process(EngineCoreOutputs(rejected=[("a", "no room")]))
        assert isinstance(a.error, ValueError) and "no room" in str(a.error)
        assert b.error is None
        outs.fail_all(RuntimeError("gone"))
        assert isinstance(b.error, RuntimeError) and b.event.is_set()
        assert isinstance(a.error, ValueError)  # the first error stays

    run(go())


def test_unknown_or_finished_ids_in_a_message_are_ignored() -> None:
    async def go():
        outs, inputs = make()
        st_ = add(outs, inputs, "r", SamplingParams(max_tokens=4, temperature=0.0))
        assert outs.process(step("gone", ids("abc"), finished=[done("gone")])) == []
        assert outs.take(st_) is None and not st_.event.is_set()

    run(go())


def test_bad_kinds_and_duplicate_ids_are_refused_and_change_nothing() -> None:
    async def go():
        outs, inputs = make()
        prep = inputs.prepare("ab", SamplingParams(max_tokens=3))
        with pytest.raises(ValueError, match="output_kind"):
            outs.add("r", prep, "everything", 0.0)
        beam = inputs.prepare("ab", SamplingParams(n=2, use_beam_search=True, temperature=0.0))
        with pytest.raises(ValueError, match="output_kind='final'"):
            outs.add("r", beam, "delta", 0.0)
        assert len(outs) == 0
        outs.add("r", prep, "delta", 0.0)
        with pytest.raises(ValueError, match="already running"):
            outs.add("r", prep, "final", 0.0)
        assert len(outs) == 1 and outs._requests["r"].kind == "delta"

    run(go())


def test_without_a_tokenizer_token_ids_only() -> None:
    async def go():
        outs, inputs = make(tokenizer=None)
        st_ = outs.add("r", inputs.prepare([1, 2], SamplingParams(max_tokens=3)), "delta", 0.0)
        outs.process(step("r", [5, 6], finish=("length", None), finished=[done("r")]))
        out = outs.take(st_)
        assert out.outputs[0].text == "" and out.outputs[0].token_ids == [5, 6]

    run(go())


def test_prompt_logprobs_come_with_the_first_delta() -> None:
    import pickle

    async def go():
        outs, inputs = make()
        st_ = add(outs, inputs, "r", SamplingParams(max_tokens=3, temperature=0.0,
                                                    prompt_logprobs=0))
        lps = [None, {ALPHABET.index("b"): -1.5}]
        msg = step("r", ids("c"))
        msg.prompt_logprobs = [("r", pickle.dumps(lps))]
        outs.process(msg)
        first = outs.take(st_)
        assert first.prompt_logprobs == lps and first.outputs[0].text == "c"
        outs.process(step("r", ids("d"), finish=("length", None), finished=[done("r")]))
        assert outs.take(st_).prompt_logprobs == lps

    run(go())
