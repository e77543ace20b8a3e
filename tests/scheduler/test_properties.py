"""Hypothesis: random arrivals, lengths, budgets, memory, n, beams and abort times.

Checked at every step (sched_harness.check_step): the token budget and max_num_seqs are never
exceeded, a group is never partly running, groups sample in lockstep, the block manager's own
invariants hold, and the fake model reads back exactly the sequence's tokens from the shadow KV
cache. At the end: every request ended, nothing leaked (all GPU and CPU blocks free), and every
request that was neither aborted nor ended for lack of memory generated exactly what the
scheduler-free reference generates.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_harness import (
    EOS,
    FakeModel,
    actual_outputs,
    assert_all_free,
    check_states,
    check_step,
    reference_outputs,
)

from pagedkv.scheduler import (
    AsyncScheduler,
    FinishReason,
    RequestParams,
    Scheduler,
    SchedulerConfig,
    SequenceStatus,
)

PREFIXES = [[], [3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 9, 2, 7, 7, 7]]


@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: RequestParams
    arrive: int  # step at which it is added
    abort: int | None  # step at which it is aborted
    abort_mid: bool  # abort between schedule() and update()


@st.composite
def scenarios(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(6, 40))
    chunked = draw(st.booleans())
    # sometimes a budget smaller than a group's sequences: the lockstep paths (a group waits,
    # running or swapped, until one step can take all its sequences)
    budget = draw(st.one_of(st.integers(2, 48), st.integers(2, 4)))
    if not chunked:
        budget = max(budget, max_model_len)
    max_n = draw(st.integers(1, 3))
    roomy = draw(st.booleans())
    blocks_for_one = -(-max_model_len // bs)
    if roomy:  # any one group fits alone: every non-aborted request must match the reference
        gpu = draw(st.integers(max_n * blocks_for_one + 1, max_n * blocks_for_one + 8))
    else:
        gpu = draw(st.integers(2, max_n * blocks_for_one + 4))
    cpu = draw(st.sampled_from([0, 4, 16, 64]))
    mode = draw(st.sampled_from([None, "recompute", "swap", "swap"]))
    if mode == "swap" and cpu == 0:
        mode = None
    cfg = SchedulerConfig(
        block_size=bs,
        num_gpu_blocks=gpu,
        num_cpu_blocks=cpu,
        max_num_seqs=draw(st.integers(max_n, 8)),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode=mode,
        watermark=draw(st.sampled_from([0.0, 0.01, 0.2])),
    )
    reqs = []
    for i in range(draw(st.integers(1, 9))):
        prefix = draw(st.sampled_from(PREFIXES))
        tail = draw(st.lists(st.integers(0, 12), min_size=0 if prefix else 1, max_size=14))
        prompt = prefix + tail
        if draw(st.integers(0, 9)):  # mostly prompts that can run; sometimes too long
            prompt = prompt[: max(1, min(len(prompt), max_model_len - 2))]
        n = draw(st.integers(1, max_n))
        max_tokens = draw(st.one_of(st.none(), st.integers(1, 30)))
        params = RequestParams(
            n=n,
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, min(3, max_tokens or 3))),
            stop_token_ids=draw(st.sampled_from([(), (), (5,), (5, 11)])),
            eos_token_id=draw(st.sampled_from([None, None, EOS])),
            ignore_eos=draw(st.booleans()),
        )
        kind = "beam" if n > 1 and draw(st.booleans()) else "req"
        abort = draw(st.one_of(st.none(), st.none(), st.integers(0, 30)))
        reqs.append(
            Req(
                f"{kind}{i}",
                prompt,
                params,
                draw(st.integers(0, 6)),
                abort,
                draw(st.booleans()),
            )
        )
    return cfg, reqs


@pytest.mark.slow
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios())
def test_random_workloads_end_cleanly_and_match_reference(scenario):
    cfg, reqs = scenario
    sched = Scheduler(cfg)
    model = FakeModel(sched)
    groups = {}
    aborted = set()
    reported = set()
    max_len = min(cfg.max_model_len, cfg.num_gpu_blocks * cfg.block_size)
    step = 0

    def never_fits(r: Req) -> bool:
        n = r.params.n
        return len(r.prompt) + 1 > max_len or n > cfg.max_num_seqs or n > cfg.max_num_batched_tokens

    pending = sorted(reqs, key=lambda r: r.arrive)
    while pending or sched.has_unfinished():
        assert step < 3000, "livelock: requests never finish"
        while pending and pending[0].arrive <= step:
            r = pending.pop(0)
            groups[r.rid] = sched.add_request(r.rid, r.prompt, r.params, arrival_time=float(step))
        for r in reqs:
            if r.abort == step and not r.abort_mid and r.rid in groups and sched.abort(r.rid):
                aborted.add(r.rid)
        out = sched.schedule()
        check_step(sched, out)
        for g in out.finished:
            assert g.is_finished and g.request_id not in reported
            reported.add(g.request_id)
        samples = model.run(out)
        for r in reqs:
            if r.abort == step and r.abort_mid and r.rid in groups and sched.abort(r.rid):
                aborted.add(r.rid)
        sched.update(out, samples)
        check_states(sched)
        step += 1
    assert not model.corruptions, model.corruptions[:5]
    assert_all_free(sched)
    st_ = sched.stats()
    if st_.num_recompute_preemptions:
        event("preempted by recompute")
    if st_.num_swap_preemptions:
        event("preempted by swap")
    if any(len(g.all_seqs()) > 1 for g in groups.values()):
        event("forked")
    if any(
        s.finish_reason is FinishReason.ABORTED
        for g in groups.values()
        for s in g.all_seqs()
        if g.finish_reason is None
    ):
        event("beam pruned")
    if st_.num_rejected:
        event("rejected")
    if aborted:
        event("aborted")
    for r in reqs:
        g = groups[r.rid]
        assert g.is_finished and g.state is SequenceStatus.FINISHED
        assert all(s.is_finished for s in g.all_seqs())
        if g.finish_reason is FinishReason.REJECTED:
            assert r.rid in reported and g.reason_text
            assert never_fits(r)
            continue
        assert not never_fits(r)
        if r.rid in aborted:
            assert g.finish_reason is FinishReason.ABORTED and r.rid in reported
            continue
        if g.reason_text:  # ended for lack of KV memory (only when not roomy)
            assert r.rid in reported
            event("ended for lack of memory")
            continue
        assert actual_outputs(g) == reference_outputs(r.rid, r.prompt, r.params, max_len)


@pytest.mark.slow
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios())
def test_scheduling_ahead_gives_the_same_outputs(scenario):
    """The same random workloads driven as an asynchronous engine does: whenever
    `can_schedule_ahead()`, the next batch is scheduled and run before the one in flight is
    applied (the fake model reads the token in flight from that batch's samples); otherwise
    the one in flight is applied first. Same outputs as the reference, nothing leaked."""
    cfg, reqs = scenario
    sched = AsyncScheduler(cfg)
    model = FakeModel(sched)
    groups = {}
    aborted = set()
    max_len = min(cfg.max_model_len, cfg.num_gpu_blocks * cfg.block_size)
    pending_reqs = sorted(reqs, key=lambda r: r.arrive)
    inflight = None  # (output, samples) run but not applied
    ahead_steps = 0
    step = 0
    while pending_reqs or sched.has_unfinished() or inflight is not None:
        assert step < 3000, "livelock: requests never finish"
        while pending_reqs and pending_reqs[0].arrive <= step:
            r = pending_reqs.pop(0)
            groups[r.rid] = sched.add_request(r.rid, r.prompt, r.params, arrival_time=float(step))
        for r in reqs:
            if r.abort == step and r.rid in groups and sched.abort(r.rid):
                aborted.add(r.rid)
        if inflight is not None and sched.can_schedule_ahead():
            out = sched.schedule_ahead()
            ahead_steps += 1
            tokens = {sid: toks[0] for sid, toks in inflight[1].items() if len(toks) == 1}
            samples = model.run(out, tokens)
            sched.update(*inflight)
        else:
            if inflight is not None:
                sched.update(*inflight)
            out = sched.schedule()
            check_step(sched, out)
            samples = model.run(out)
        inflight = (out, samples)
        check_states(sched)
        if not sched.has_unfinished():
            sched.update(*inflight)
            inflight = None
        step += 1
    assert not model.corruptions, model.corruptions[:5]
    assert_all_free(sched)
    if ahead_steps:
        event("scheduled ahead")
    for r in reqs:
        g = groups[r.rid]
        assert g.is_finished
        if g.finish_reason is FinishReason.REJECTED or r.rid in aborted or g.reason_text:
            continue
        assert actual_outputs(g) == reference_outputs(r.rid, r.prompt, r.params, max_len)
