"""The engine core's wire format (`pagedkv.engine.core.messages`): what goes in comes out, a
new `SamplingParams` field travels without a schema change, and the counters keep the engine's
names. No model, no process."""

from __future__ import annotations

import dataclasses
import math
import pickle
from types import SimpleNamespace

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.core.engine_core import core_params, wants_final
from pagedkv.engine.core.messages import (
    CoreStats,
    Encoder,
    EngineCoreOutputs,
    EngineCoreRequest,
    EntryLogprobs,
    FinishedRequest,
    SeqFinish,
    decoder,
)
from pagedkv.engine.llm_engine import EngineStats
from pagedkv.engine.sampling_params import SamplingParams

ids = st.lists(st.integers(0, 2**31 - 1), max_size=6)
reason = st.sampled_from(["stop", "length", "abort"])
stop_reason = st.one_of(st.none(), st.integers(0, 100_000), st.text(min_size=1, max_size=5))
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def step_messages(draw) -> EngineCoreOutputs:
    n = draw(st.integers(0, 8))
    rids = draw(st.lists(st.sampled_from(["a", "b-1", "cmpl-0"]), min_size=n, max_size=n))
    entries = list(range(n))
    fins = [SeqFinish(i, draw(reason), draw(stop_reason))
            for i in draw(st.lists(st.sampled_from(entries), unique=True)) ] if n else []
    lps = [EntryLogprobs(i, draw(st.one_of(finite, st.just(-math.inf))), draw(st.integers(1, 9)),
                         draw(ids), draw(st.lists(finite, max_size=6)))
           for i in draw(st.lists(st.sampled_from(entries), unique=True))] if n else []
    finished = [
        FinishedRequest(rid, draw(st.booleans()), [(0, draw(reason), draw(stop_reason))],
                        draw(finite), draw(st.none() | finite), draw(st.none() | finite),
                        draw(st.none() | st.binary(max_size=8)))
        for rid in draw(st.lists(st.sampled_from(["a", "z"]), unique=True))
    ]
    return EngineCoreOutputs(
        request_ids=rids, seq_indices=draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),
        token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        seq_finishes=fins, logprobs=lps, finished=finished,
        rejected=draw(st.lists(st.tuples(st.text(max_size=4), st.text(max_size=20)), max_size=2)),
        queues=draw(st.none() | st.tuples(*[st.integers(0, 999)] * 3)),
        stats=draw(st.none() | st.builds(CoreStats, num_running=st.integers(0, 99),
                                         gpu_kv_usage=st.floats(0, 1))),
        prompt_logprobs=draw(st.lists(st.tuples(st.sampled_from(["a", "z"]),
                                                st.binary(max_size=8)), max_size=2)),
        timestamp=draw(finite),
    )


@settings(max_examples=150, deadline=None)
@given(step_messages())
def test_step_message_round_trip(msg: EngineCoreOutputs) -> None:
    wire = Encoder().encode(msg)
    assert decoder(EngineCoreOutputs).decode(wire) == msg


def test_step_message_is_flat_lists_not_objects_per_token() -> None:
    """A step of 1,000 decodes is three flat lists on the wire: no field names, no per-token
    structure (about 8 bytes a token with a short request id)."""
    n = 1000
    msg = EngineCoreOutputs(request_ids=[f"r{i}" for i in range(n)], seq_indices=[0] * n,
                            token_ids=list(range(50_000, 50_000 + n)), timestamp=1.0)
    wire = Encoder().encode(msg)
    assert len(wire) < 9 * n
    assert b"token_ids" not in wire and b"request_ids" not in wire


def test_request_carries_every_sampling_field_even_new_ones() -> None:
    params = SamplingParams(n=2, temperature=0.7, top_k=5, seed=3, stop_token_ids=[9],
                            logprobs=2, max_tokens=7)
    params.a_field_added_later = {"bias": {3: -1.5}}  # e.g. a future SamplingParams field
    req = EngineCoreRequest.of("r", [1, 2, 3], params, 12.5)
    back = decoder(EngineCoreRequest).decode(Encoder().encode(req))
    assert back.request_id == "r" and back.prompt_token_ids == [1, 2, 3]
    assert back.arrival_time == 12.5
    got = back.sampling_params()
    assert got == params and got.a_field_added_later == {"bias": {3: -1.5}}


def test_core_params_leave_text_work_to_the_api_process() -> None:
    user = SamplingParams(stop=["\n", "END"], include_stop_str_in_output=True, max_tokens=5)
    core = core_params(user)
    assert core.stop == [] and not core.detokenize and not core.include_stop_str_in_output
    assert core.max_tokens == 5
    # the user's object is untouched
    assert user.stop == ["\n", "END"] and user.detokenize and user.include_stop_str_in_output
    plain = SamplingParams(detokenize=False)
    assert core_params(plain) is plain
    assert wants_final(SamplingParams(use_beam_search=True, n=2, temperature=0.0))
    assert not wants_final(SamplingParams(n=2))


def test_core_stats_have_the_engine_stats_names() -> None:
    """/metrics reads the counters by EngineStats' names: both must list the same fields."""
    names = {f.name for f in dataclasses.fields(EngineStats)}
    assert set(CoreStats.__struct_fields__) == names
    stats = EngineStats(**{name: i for i, name in enumerate(sorted(names))})
    assert msgspec.structs.asdict(CoreStats.of(stats)) == dataclasses.asdict(stats)


class _StubOutputs:
    """An output processor's outside, as `EngineCore` uses it."""

    def __init__(self) -> None:
        self.deltas = None
        self.prompt_lps: dict[str, list] = {}

    def prompt_logprobs_of(self, rid: str):
        return self.prompt_lps.get(rid)


class _StubEngine:
    """An `LLMEngine`'s outside: requests are queued, `step` appends one token each (through
    the output processor's `StepDeltas`, as the real one does) and a request ends after two."""

    def __init__(self) -> None:
        self.outputs = _StubOutputs()
        self.live: dict[str, int] = {}
        self.emit_partial_outputs = True

    def prepare_request(self, ids, params):
        if not ids:
            raise ValueError("the prompt is empty")
        return SimpleNamespace(prompt_token_ids=list(ids), params=params)

    def add_prepared_request(self, rid, prep, arrival):
        self.live[rid] = 0

    def abort_request(self, ids):
        for rid in ids:
            self.live.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def get_stats(self):
        return EngineStats(num_running=len(self.live))

    @property
    def scheduler(self):
        return SimpleNamespace(num_running=len(self.live), num_waiting=0, num_swapped=0)

    def step(self):
        from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

        d = self.outputs.deltas
        done = []
        for rid in list(self.live):
            self.live[rid] += 1
            d.request_ids.append(rid)
            d.seq_indices.append(0)
            d.token_ids.append(100 + self.live[rid])
            if self.live[rid] == 2:
                d.finishes.append((len(d.token_ids) - 1, "length", None))
                del self.live[rid]
                done.append(RequestOutput(rid, None, [1], [CompletionOutput(
                    0, "", [101, 102], 0.0, None, "length")], True, RequestMetrics(0.0)))
        return done


def test_engine_core_turns_steps_into_messages_and_sends_prompt_logprobs_once() -> None:
    from pagedkv.engine.core.engine_core import EngineCore

    engine = _StubEngine()
    core = EngineCore(engine)
    assert engine.outputs.deltas is not None and not engine.emit_partial_outputs
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    core.add_request(EngineCoreRequest.of("a", [1, 2, 3], greedy, 0.0))
    core.add_request(EngineCoreRequest.of("b", [1, 2], SamplingParams(prompt_logprobs=1), 0.0))
    core.add_request(EngineCoreRequest.of("bad", [], greedy, 0.0))
    engine.outputs.prompt_lps["b"] = [None]  # one of two prompt positions computed so far
    first = core.step()
    assert first.request_ids == ["a", "b"] and first.token_ids == [101, 101]
    assert first.rejected == [("bad", "the prompt is empty")]
    assert first.prompt_logprobs == [] and first.finished == []
    engine.outputs.prompt_lps["b"] = [None, {7: -0.5}]
    second = core.step()
    assert second.seq_finishes == [SeqFinish(0, "length"), SeqFinish(1, "length")]
    assert [f.request_id for f in second.finished] == ["a", "b"]
    assert not any(f.aborted for f in second.finished)
    ((rid, blob),) = second.prompt_logprobs
    assert rid == "b" and pickle.loads(blob) == [None, {7: -0.5}]
    assert second.stats is not None and second.stats.num_running == 0  # idle: counters sent
    assert core.idle_message() is None  # nothing new to say
    # every message survives the wire
    for msg in (first, second):
        assert decoder(EngineCoreOutputs).decode(Encoder().encode(msg)) == msg


def test_queue_lengths_follow_every_step_between_the_counters() -> None:
    """The full counters go out every `STATS_INTERVAL_S`; the batch size (running, waiting,
    swapped) with each step that changes it, so a /metrics scrape sees short requests run."""
    from pagedkv.engine.core.engine_core import EngineCore

    engine = _StubEngine()
    core = EngineCore(engine)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    core.add_request(EngineCoreRequest.of("a", [1], greedy, 0.0))
    assert core.step().stats.num_running == 1  # the first counters: not sent yet
    core.add_request(EngineCoreRequest.of("b", [1], greedy, 0.0))
    core.add_request(EngineCoreRequest.of("c", [1], greedy, 0.0))
    grown = core.step()  # a ends, b and c run: within the interval, so no counters
    assert grown.stats is None and grown.queues == (2, 0, 0)
    core.add_request(EngineCoreRequest.of("d", [1], greedy, 0.0))
    core.add_request(EngineCoreRequest.of("e", [1], greedy, 0.0))
    same = core.step()  # b and c end, d and e run: the same lengths, not sent again
    assert same.stats is None and same.queues is None and not same.is_empty
    last = core.step()  # d and e end: idle, so the counters go out
    assert last.stats is not None and last.stats.num_running == 0 and last.queues is None
