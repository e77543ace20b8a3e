"""Asynchronous scheduling (step N+1 built and launched before step N's tokens are applied)
gives the same outputs as the plain loop, on the real embedded model on the CPU, whatever
ends the requests: length, stop tokens, stop strings, aborts in flight, the maximum context
length; and it hands over to the plain loop and back when memory runs short, when a request
needs more than an argmax, and with prefix caching. No block is left behind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Hi",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is the largest planet in the solar system?\nA:",
]


@pytest.fixture(scope="module")
def make_engine(embedded_model) -> Callable[..., LLMEngine]:
    def make(async_scheduling: bool, **overrides: Any) -> LLMEngine:
        opts: dict[str, Any] = dict(device="cpu", kv_cache_gb=0.05, swap_space=0.02, seed=0)
        opts.update(overrides)
        return LLMEngine(EngineArgs(async_scheduling=async_scheduling, **opts),
                         model=embedded_model)

    return make


def run(engine: LLMEngine, params: list[SamplingParams], *, abort_at: dict[int, str] | None = None,
        late: dict[int, tuple[str, str, SamplingParams]] | None = None) -> dict[str, tuple]:
    """Run every prompt to its end; `abort_at[step]`: abort that request before that step;
    `late[step]`: add (id, prompt, params) then. Checks that nothing leaked."""
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r{i}", p, sp)
    finals: dict[str, tuple] = {}
    step = 0
    while engine.has_unfinished_requests() or (late and any(k >= step for k in late)):
        if abort_at and step in abort_at:
            engine.abort_request(abort_at[step])
        if late and step in late:
            engine.add_request(*late[step])
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                finals[out.request_id] = (c.token_ids, c.finish_reason, c.stop_reason, c.text)
        step += 1
        assert step < 500, "the engine did not finish"
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
    assert stats.gpu_kv_usage == 0.0 and stats.cpu_kv_usage == 0.0, "KV blocks leaked"
    assert engine._async is None or engine._async.in_flight is None
    assert engine.scheduler.block_manager.num_seqs == 0
    return finals


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def plain_tokens(make_engine) -> list[list[int]]:
    finals = run(make_engine(False), [greedy(16, ignore_eos=True)] * len(PROMPTS))
    return [finals[f"r{i}"][0] for i in range(len(PROMPTS))]


def compare(make_engine, params: list[SamplingParams], engine: dict | None = None, **kw: Any):
    """Both loops on the same requests: identical outputs, except that a request aborted while
    a step was in flight may miss that step's token (it is discarded with the request)."""
    plain = run(make_engine(False, **(engine or {})), params, **kw)
    ahead_engine = make_engine(True, **(engine or {}))
    ahead = run(ahead_engine, params, **kw)
    assert ahead.keys() == plain.keys()
    for rid, got in ahead.items():
        want = plain[rid]
        if want[1] == "abort":
            assert got[1] == "abort" and want[0][: len(got[0])] == got[0], rid
            assert len(want[0]) - len(got[0]) <= 1, rid
        else:
            assert got == want, rid
    return plain, ahead_engine


def test_same_tokens_with_lengths_stop_tokens_and_eos(make_engine, plain_tokens):
    # Stop tokens taken from the plain run, so that requests stop at different steps, some
    # in the middle of a batch that was already scheduled ahead.
    params = [
        greedy(16, ignore_eos=True),
        greedy(16, stop_token_ids=[plain_tokens[1][5]]),
        greedy(3, ignore_eos=True),
        greedy(16, stop_token_ids=[plain_tokens[3][7], plain_tokens[3][8]]),
        greedy(13),
        greedy(16, stop_token_ids=[plain_tokens[5][0]]),  # stops at its first token
    ]
    plain, _ = compare(make_engine, params)
    reasons = {k: v[1] for k, v in plain.items()}
    assert reasons["r1"] == "stop" and reasons["r5"] == "stop" and reasons["r2"] == "length"
    assert len(plain["r5"][0]) == 1


def test_same_text_with_stop_strings(make_engine, plain_tokens, embedded_tokenizer):
    text = embedded_tokenizer.decode(plain_tokens[0][:12])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = [greedy(16, stop=[stop])] + [greedy(10 + i, ignore_eos=True) for i in range(1, 6)]
    plain, _ = compare(make_engine, params)
    assert plain["r0"][1] == "stop" and plain["r0"][2] == stop


def test_aborts_and_late_requests_while_a_step_is_in_flight(make_engine):
    params = [greedy(14, ignore_eos=True)] * len(PROMPTS)
    late = {4: ("late", "Name three fruits:", greedy(8, ignore_eos=True)),
            9: ("later", "Hi", greedy(5, ignore_eos=True))}
    plain, _ = compare(make_engine, params, abort_at={3: "r1", 6: "r4", 7: "late"}, late=late)
    assert plain["r1"][1] == plain["r4"][1] == plain["late"][1] == "abort"
    assert plain["later"][1] == "length"


def test_requests_that_reach_the_maximum_context_length(make_engine):
    params = [greedy(64, ignore_eos=True)] * len(PROMPTS)
    plain, _ = compare(make_engine, params, engine=dict(max_model_len=32))
    assert all(v[1] == "length" for v in plain.values())


@pytest.mark.parametrize("name, engine", [
    ("recompute", dict(num_gpu_blocks_override=9, preemption_mode="recompute")),
    ("swap", dict(num_gpu_blocks_override=9, num_cpu_blocks_override=64, preemption_mode="swap")),
    ("chunked-prefill", dict(max_num_batched_tokens=8)),
    ("prefix-caching", dict(enable_prefix_caching=True)),
])
def test_hands_over_to_the_plain_loop_under_pressure(make_engine, plain_tokens, name, engine):
    params = [greedy(16, ignore_eos=True)] * len(PROMPTS)
    plain, ahead_engine = compare(make_engine, params, engine=engine)
    assert [plain[f"r{i}"][0] for i in range(len(PROMPTS))] == plain_tokens
    if name in ("recompute", "swap"):
        assert ahead_engine.get_stats().num_preemptions > 0


def test_sampling_requests_run_in_the_plain_loop_beside_greedy_ones(make_engine):
    params = [greedy(12, ignore_eos=True), SamplingParams(max_tokens=12, temperature=0.8, seed=3,
                                                          ignore_eos=True)]
    params += [greedy(12, ignore_eos=True, logprobs=2)] + [greedy(9, ignore_eos=True)] * 3
    compare(make_engine, params)


def test_schedule_ahead_is_refused_when_it_cannot_hold(make_engine):
    engine = make_engine(True)
    sched = engine.scheduler
    assert not sched.can_schedule_ahead()  # nothing scheduled yet
    with pytest.raises(RuntimeError, match="schedule_ahead"):
        sched.schedule_ahead()
    engine.add_request("x", PROMPTS[0], greedy(4, ignore_eos=True))
    out = sched.schedule()
    assert sched.can_schedule_ahead()
    ahead = sched.schedule_ahead()
    assert ahead.scheduled[0].start == len(ahead.scheduled[0].all_token_ids)
    with pytest.raises(ValueError, match="order"):
        sched.update(ahead, {ahead.scheduled[0].seq_id: [1]})
    sched.update(out, {out.scheduled[0].seq_id: [1]})
    sched.update(ahead, {ahead.scheduled[0].seq_id: [2]})
    assert sched.get_group("x").seqs[0].token_ids[-2:] == [1, 2]
    sched.abort("x")


def test_greedy_requests_under_token_masks_run_ahead_with_the_same_tokens(make_engine):
    """Structured output (a JSON schema, a regex), `allowed_token_ids` and `bad_words` at
    temperature 0 beside plain greedy requests: scheduled ahead (the masks are built once the
    step before is applied, while the next pass runs), the same outputs as the plain loop."""
    import json

    import jsonschema

    from pagedkv.engine.structured import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = [
        greedy(40, structured_outputs=SO(json=schema)),
        greedy(12, ignore_eos=True),
        greedy(16, structured_outputs=SO(regex=r"[a-z]+( [a-z]+)*\.")),
        greedy(10, ignore_eos=True, allowed_token_ids=list(range(200, 400))),
        greedy(12, ignore_eos=True, bad_words=[" the", " a"]),
        greedy(9, ignore_eos=True),
    ]
    plain, ahead_engine = compare(make_engine, params)
    jsonschema.validate(json.loads(plain["r0"][3]), schema)
    assert all(200 <= t < 400 for t in plain["r3"][0])
    ran_ahead = ahead_engine.scheduler.num_scheduled_ahead
    assert ran_ahead > 10, f"only {ran_ahead} steps were scheduled ahead"


def test_a_mask_that_fails_in_flight_ends_its_batch_not_the_engine(make_engine, monkeypatch):
    """A token mask that cannot be built for a pass scheduled ahead: that batch's requests end
    as aborted, their blocks are freed, and the engine serves the next request."""
    from pagedkv.engine.structured import StructuredOutputsParams as SO
    from pagedkv.engine.worker.token_masks import TokenMasks

    engine = make_engine(True)
    build = TokenMasks.build_masked_rows
    calls = {"n": 0}

    def flaky(self, seqs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("mask failed")
        return build(self, seqs)

    monkeypatch.setattr(TokenMasks, "build_masked_rows", flaky)
    finals = run(engine, [greedy(30, structured_outputs=SO(regex=r"[a-z ]+")),
                          greedy(30, ignore_eos=True)] + [greedy(4, ignore_eos=True)] * 4)
    assert calls["n"] >= 5
    assert finals["r0"][1] == "abort" and finals["r1"][1] == "abort"
    assert engine.scheduler.num_scheduled_ahead > 0
    monkeypatch.setattr(TokenMasks, "build_masked_rows", build)
    engine.add_request("after", "Hi", greedy(5, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [len(o.outputs[0].token_ids) for o in outs] == [5]
    assert engine.get_stats().gpu_kv_usage == 0.0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_dropped_engine_is_freed_at_once(make_engine, async_scheduling):
    """No reference cycle keeps an engine (its KV cache, on a GPU its weights too) alive after
    its last reference goes: a second engine in the same process must find the memory free
    without waiting for the garbage collector."""
    import gc
    import weakref

    engine = make_engine(async_scheduling)
    run(engine, [SamplingParams(max_tokens=4, temperature=0.0)] * 2)
    gone, kv = weakref.ref(engine), weakref.ref(engine.runner)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del engine
        assert gone() is None and kv() is None
    finally:
        if was_enabled:
            gc.enable()
