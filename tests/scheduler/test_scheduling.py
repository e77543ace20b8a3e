"""Deterministic scenarios with exact expectations: order, budget, chunking, preemption, swap,
abort, rejection, forks and beams, stop conditions, prefix caching."""

from __future__ import annotations

import pytest
from sched_harness import (
    FakeModel,
    actual_outputs,
    assert_all_free,
    check_states,
    check_step,
    drive,
    drive_ahead,
    make,
    reference_outputs,
)

from pagedkv.scheduler import (
    AsyncScheduler,
    FinishReason,
    PreemptionMode,
    RequestParams,
    Scheduler,
    SchedulerConfig,
    SequenceStatus,
)


def plan(out):
    return [(s.request_id, s.start, s.num_tokens, s.do_sample) for s in out.scheduled]


def step(sched, tok=7):
    """schedule() + update() with the same token for every sampled sequence."""
    out = sched.schedule()
    check_step(sched, out)
    res = sched.update(out, {s.seq_id: [tok] for s in out.scheduled if s.do_sample})
    check_states(sched)
    return out, res



def step_with(sched, model):
    """schedule() + update() with the fake model's tokens, checked like `step`."""
    out = sched.schedule()
    check_step(sched, out)
    res = sched.update(out, model.run(out))
    check_states(sched)
    return out, res

P3 = RequestParams(max_tokens=3)


# ---------------------------------------------------------------- order, budget, chunking
def test_fcfs_order_budget_and_chunked_prefill_mix_with_decodes():
    sched = make(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=10, max_model_len=64)
    sched.add_request("a", [1] * 6, P3)
    sched.add_request("b", [2] * 7, P3)
    sched.add_request("c", [3] * 3, P3)
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert out.num_batched_tokens == 10
    assert [s.is_prefill for s in out.scheduled] == [True, True]
    assert out.scheduled[1].token_ids == [2, 2, 2, 2]
    out, _ = step(sched)
    # decodes first, then the rest of b's prompt, then c (FCFS)
    assert plan(out) == [("a", 6, 1, True), ("b", 4, 3, True), ("c", 0, 3, True)]
    assert [s.is_prefill for s in out.scheduled] == [False, True, True]
    assert out.scheduled[0].token_ids == [7]
    out, res = step(sched)
    assert plan(out) == [("a", 7, 1, True), ("b", 7, 1, True), ("c", 3, 1, True)]
    assert [g.request_id for g in res.finished_groups] == ["a"]
    assert res.finished_seqs[0].finish_reason is FinishReason.LENGTH
    out, res = step(sched)
    assert plan(out) == [("b", 8, 1, True), ("c", 4, 1, True)]
    assert [g.request_id for g in res.finished_groups] == ["b", "c"]
    assert not sched.has_unfinished()
    assert_all_free(sched)


def test_long_prompt_is_split_into_exact_chunks_and_samples_once():
    sched = make(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16, max_model_len=64)
    sched.add_request("long", list(range(50)), RequestParams(max_tokens=2))
    chunks = []
    for _ in range(4):
        out, _ = step(sched)
        chunks.append(plan(out))
    assert chunks == [
        [("long", 0, 16, False)],
        [("long", 16, 16, False)],
        [("long", 32, 16, False)],
        [("long", 48, 2, True)],
    ]
    out, res = step(sched)
    assert plan(out) == [("long", 50, 1, True)]
    assert res.finished_groups and not sched.has_unfinished()


def test_budget_smaller_than_decodes_stops_in_order():
    sched = make(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=2, max_model_len=64)
    for r in "abc":
        sched.add_request(r, [1], RequestParams(max_tokens=5))
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 1, True), ("b", 0, 1, True)]
    out, _ = step(sched)  # running a and b use the whole budget: c waits (no skipping)
    assert plan(out) == [("a", 1, 1, True), ("b", 1, 1, True)]
    assert [g.request_id for g in sched.waiting] == ["c"]


def test_max_num_seqs_counts_sequences_of_parallel_sampling():
    sched = make(block_size=4, num_gpu_blocks=64, max_num_seqs=3, max_model_len=64)
    sched.add_request("pair", [1, 2], RequestParams(n=2, max_tokens=4))
    sched.add_request("single", [3], RequestParams(max_tokens=4))
    sched.add_request("late", [4], RequestParams(max_tokens=4))
    out, _ = step(sched)
    # "pair" reserves 2 sequence slots before it forks: only one more request fits
    assert [s.request_id for s in out.scheduled] == ["pair", "single"]
    assert [g.request_id for g in sched.waiting] == ["late"]


def test_without_chunked_prefill_a_prompt_is_never_split():
    sched = make(
        block_size=4,
        num_gpu_blocks=64,
        max_num_batched_tokens=12,
        max_model_len=12,
        enable_chunked_prefill=False,
    )
    sched.add_request("a", [1] * 5, RequestParams(max_tokens=3))
    sched.add_request("c", [3] * 2, RequestParams(max_tokens=2))
    sched.add_request("b", [2] * 11, RequestParams(max_tokens=1))
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 5, True), ("c", 0, 2, True)]  # b (11) > 5 left: not split
    out, _ = step(sched)
    assert plan(out) == [("a", 5, 1, True), ("c", 2, 1, True)]  # 11 > 10: still waiting
    out, _ = step(sched)  # c finished
    assert plan(out) == [("a", 6, 1, True), ("b", 0, 11, True)]


def test_watermark_holds_back_admission_unless_nothing_runs():
    sched = Scheduler(
        SchedulerConfig(block_size=4, num_gpu_blocks=20, max_model_len=64, watermark=0.2)
    )  # 4 blocks kept free
    sched.add_request("big", [1] * 40, RequestParams(max_tokens=2))  # 10 blocks
    sched.add_request("next", [2] * 28, RequestParams(max_tokens=2))  # 7 blocks
    out, _ = step(sched)
    # big is admitted although it leaves 10 free (nothing else runs); next would leave 3 < 4
    assert plan(out) == [("big", 0, 40, True)]
    assert sched.block_manager.num_free_blocks == 10
    sched.abort("big")
    out, _ = step(sched)
    assert plan(out) == [("next", 0, 28, True)]


# ------------------------------------------------------------------------- preemption
def _three_small(mode, cpu=0):
    sched = make(
        block_size=4,
        num_gpu_blocks=3,
        num_cpu_blocks=cpu,
        max_model_len=16,
        preemption_mode=mode,
    )
    sched.add_request("a", [1, 2, 3, 4], RequestParams(max_tokens=2))
    sched.add_request("b", [5, 6], RequestParams(max_tokens=4))
    sched.add_request("c", [7, 8], RequestParams(max_tokens=4))
    return sched


def test_preemption_picks_the_latest_arrival_recompute():
    sched = _three_small("recompute")
    model = FakeModel(sched)
    out = sched.schedule()
    groups = {g.request_id: g for g in sched.running}
    assert plan(out) == [("a", 0, 4, True), ("b", 0, 2, True), ("c", 0, 2, True)]
    assert sched.block_manager.num_free_blocks == 0
    sched.update(out, model.run(out))
    out = sched.schedule()
    # a needs a second block for position 4: c (latest) goes, b (earlier) stays
    assert out.preempted == [("c", PreemptionMode.RECOMPUTE)]
    assert plan(out) == [("a", 4, 1, True), ("b", 2, 1, True)]
    assert [g.request_id for g in sched.waiting] == ["c"]
    c = sched.get_group("c")
    assert c.state is SequenceStatus.WAITING and c.num_preemptions == 1
    assert c.seqs[0].num_computed_tokens == 0 and c.seqs[0].num_tokens == 3  # keeps its token
    assert sched.num_preemptions == 1
    sched.update(out, model.run(out))
    drive(sched, model)
    assert not model.corruptions
    assert_all_free(sched)
    assert sched.stats().num_recompute_preemptions >= 1
    for rid, prompt, mt in (("a", [1, 2, 3, 4], 2), ("b", [5, 6], 4), ("c", [7, 8], 4)):
        assert actual_outputs(groups[rid]) == reference_outputs(
            rid, prompt, RequestParams(max_tokens=mt), 12
        )


def test_preemption_by_swap_moves_blocks_and_resumes():
    sched = _three_small("swap", cpu=4)
    model = FakeModel(sched)
    out = sched.schedule()
    groups = {g.request_id: g for g in sched.running}
    sched.update(out, model.run(out))
    out = sched.schedule()
    assert out.preempted == [("c", PreemptionMode.SWAP)]
    assert out.blocks_to_swap_out == [(2, 0)]  # c's only block -> the first CPU block
    assert plan(out) == [("a", 4, 1, True), ("b", 2, 1, True)]
    assert sched.block_manager.block_table(groups["a"].seqs[0].seq_id) == [0, 2]
    c_seq = groups["c"].seqs[0]
    assert sched.block_manager.location(c_seq.seq_id) == "cpu"
    assert c_seq.num_computed_tokens == 2  # the work is kept
    sched.update(out, model.run(out))  # a finishes (max_tokens=2) and frees 2 blocks
    assert groups["a"].is_finished
    out = sched.schedule()
    assert len(out.blocks_to_swap_in) == 1 and out.blocks_to_swap_in[0][0] == 0
    assert plan(out) == [("b", 3, 1, True), ("c", 2, 1, True)]
    assert sched.block_manager.block_table(c_seq.seq_id) == [out.blocks_to_swap_in[0][1]]
    sched.update(out, model.run(out))
    drive(sched, model)
    assert not model.corruptions
    assert_all_free(sched)
    for rid, prompt, mt in (("a", [1, 2, 3, 4], 2), ("b", [5, 6], 4), ("c", [7, 8], 4)):
        assert actual_outputs(groups[rid]) == reference_outputs(
            rid, prompt, RequestParams(max_tokens=mt), 12
        )


def test_swapped_groups_resume_before_new_requests():
    sched = make(
        block_size=4, num_gpu_blocks=4, num_cpu_blocks=8, max_model_len=32, preemption_mode="swap"
    )
    sched.add_request("a", [1, 2, 3, 4], RequestParams(max_tokens=10))
    sched.add_request("b", [5, 6], RequestParams(max_tokens=10))
    sched.add_request("c", list(range(8)), RequestParams(max_tokens=10))
    model = FakeModel(sched)
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, model.run(out))
    assert out.preempted == [("c", PreemptionMode.SWAP)]
    assert sched.block_manager.num_free_blocks == 1
    sched.add_request("new", [9], RequestParams(max_tokens=1))  # would fit in that block
    out = sched.schedule()
    assert plan(out) == [("a", 5, 1, True), ("b", 3, 1, True)]
    assert [g.request_id for g in sched.swapped] == ["c"]
    assert [g.request_id for g in sched.waiting] == ["new"]
    sched.update(out, model.run(out))
    drive(sched, model)
    assert not model.corruptions
    assert_all_free(sched)



def test_swapped_group_waits_for_a_budget_that_covers_all_its_sequences():
    """A group's sequences sample in lockstep, so a swapped group of three comes back only in
    a step whose token budget has room for all three, even while its blocks would fit."""
    sched = make(
        block_size=2, num_gpu_blocks=10, num_cpu_blocks=32, max_model_len=16,
        max_num_batched_tokens=3, enable_chunked_prefill=True, preemption_mode="swap",
    )
    reqs = [
        ("a", [1], RequestParams(max_tokens=12, ignore_eos=True)),
        ("c", [3, 3, 3], RequestParams(max_tokens=8, ignore_eos=True)),
        ("b", [2], RequestParams(n=3, max_tokens=3, ignore_eos=True)),
    ]
    groups = {rid: sched.add_request(rid, prompt, params) for rid, prompt, params in reqs}
    model = FakeModel(sched)
    bm = sched.block_manager
    waited = 0
    for _ in range(16):
        out, _ = step_with(sched, model)
        if out.preempted:
            assert out.preempted == [("b", PreemptionMode.SWAP)]
        if [g.request_id for g in sched.swapped] == ["b"] and not out.preempted:
            b_seqs = groups["b"].seqs
            assert len(b_seqs) == 3
            ids = [s.seq_id for s in b_seqs]
            assert bm.num_free_blocks >= bm.blocks_needed_to_swap_in(ids, [1, 1, 1])
            assert [s.request_id for s in out.scheduled] == ["a"]  # 1 token of 3 used
            waited += 1
        if out.blocks_to_swap_in:
            assert [s.request_id for s in out.scheduled] == ["b", "b", "b"]
            break
    assert waited == 3 and groups["c"].is_finished and groups["a"].is_finished
    drive(sched, model)
    assert not model.corruptions
    assert_all_free(sched)
    for rid, prompt, params in reqs:
        assert actual_outputs(groups[rid]) == reference_outputs(rid, prompt, params, 16)


def test_swapped_group_that_cannot_grow_even_alone_ends_for_lack_of_memory():
    """Swapped back in once it has the cache to itself, a group that still cannot get a block
    for its next tokens is ended (LENGTH, with the reason) and gives every block back."""
    sched = make(
        block_size=4, num_gpu_blocks=3, num_cpu_blocks=16, max_model_len=7,
        max_num_batched_tokens=16, enable_chunked_prefill=True, preemption_mode="swap",
    )
    a = sched.add_request("a", [1], RequestParams(max_tokens=11, ignore_eos=True))
    b = sched.add_request("b", [4], RequestParams(n=2, max_tokens=10, ignore_eos=True))
    model = FakeModel(sched)
    outs = [step_with(sched, model)[0] for _ in range(7)]
    assert outs[4].preempted == [("b", PreemptionMode.SWAP)]
    assert a.is_finished and outs[6].blocks_to_swap_in and outs[6].scheduled == []
    assert [g.request_id for g in sched.running] == ["b"]
    drive(sched, model)
    assert b.is_finished and "do not fit in the KV cache" in b.reason_text
    assert all(s.finish_reason is FinishReason.LENGTH for s in b.finished_seqs)
    assert actual_outputs(a) == reference_outputs("a", [1], a.params, 7)
    assert not model.corruptions
    assert_all_free(sched)

def _mixed_requests():
    return [
        ("r0", [1, 2, 3, 4, 5, 6, 7], RequestParams(max_tokens=9)),
        ("r1", [8, 9], RequestParams(max_tokens=12, eos_token_id=0, min_tokens=2)),
        ("r2", [3, 3, 3, 3, 3], RequestParams(n=2, max_tokens=6)),
        ("beam3", [4, 5, 6], RequestParams(n=3, max_tokens=8)),
        ("r4", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], RequestParams(max_tokens=5)),
        ("r5", [12], RequestParams(max_tokens=14, stop_token_ids=[5])),
    ]


@pytest.mark.parametrize(
    ("mode", "gpu", "cpu", "expect_preemption"),
    [
        (None, 200, 0, False),
        ("recompute", 12, 0, True),
        ("swap", 12, 40, True),
        (None, 12, 40, True),
        (None, 12, 3, True),  # swap wanted for groups, CPU too small: falls back to recompute
    ],
)
@pytest.mark.parametrize("caching", [False, True])
def test_outputs_identical_with_and_without_forced_preemption(
    mode, gpu, cpu, expect_preemption, caching
):
    sched = make(
        block_size=2,
        num_gpu_blocks=gpu,
        num_cpu_blocks=cpu,
        max_num_batched_tokens=9,
        max_model_len=24,
        preemption_mode=mode,
        enable_prefix_caching=caching,
    )
    groups = {rid: sched.add_request(rid, p, params) for rid, p, params in _mixed_requests()}
    model = FakeModel(sched)
    drive(sched, model)
    assert not model.corruptions
    assert_all_free(sched)
    assert (sched.num_preemptions > 0) == expect_preemption
    for rid, prompt, params in _mixed_requests():
        assert actual_outputs(groups[rid]) == reference_outputs(rid, prompt, params, 24), rid


# ---------------------------------------------------------------------------- abort
def test_abort_waiting_request():
    sched = make(block_size=4, num_gpu_blocks=8, max_model_len=32)
    g = sched.add_request("w", [1, 2, 3])
    assert sched.abort("w") is True
    assert g.finish_reason is FinishReason.ABORTED
    assert g.seqs == [] and g.finished_seqs[0].finish_reason is FinishReason.ABORTED
    assert sched.abort("w") is False and sched.abort("never") is False
    out = sched.schedule()
    assert out.finished == [g] and out.is_empty
    assert not sched.has_unfinished()
    assert_all_free(sched)


def test_abort_mid_prefill_between_schedule_and_update():
    sched = make(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=8, max_model_len=64)
    sched.add_request("long", list(range(20)))
    sched.add_request("short", [1])
    out = sched.schedule()
    assert plan(out) == [("long", 0, 8, False)]
    assert sched.abort("long")
    assert sched.block_manager.num_free_blocks == 16  # freed at once
    sched.update(out, {})
    out, _ = step(sched)
    assert plan(out) == [("short", 0, 1, True)]
    assert [g.request_id for g in out.finished] == ["long"]


def test_abort_running_decode_after_schedule_ignores_its_samples():
    sched = make(block_size=4, num_gpu_blocks=16, max_model_len=64)
    sched.add_request("a", [1, 2], RequestParams(max_tokens=10))
    step(sched)
    out = sched.schedule()
    seq_id = out.scheduled[0].seq_id
    assert sched.abort("a")
    res = sched.update(out, {seq_id: [3]})  # the runner already sampled it: ignored
    assert res.finished_groups == [] and res.finished_seqs == []
    assert_all_free(sched)


def test_abort_swapped_request_frees_cpu_blocks():
    sched = _three_small("swap", cpu=4)
    model = FakeModel(sched)
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, model.run(out))
    assert sched.block_manager.stats().cpu_free == 3
    assert sched.abort("c")
    assert sched.block_manager.stats().cpu_free == 4
    assert sched.num_swapped == 0
    drive(sched, model)
    assert_all_free(sched)


def test_abort_of_every_request_in_every_state_frees_everything():
    sched = _three_small("swap", cpu=4)
    sched.add_request("d", [1, 2, 3], RequestParams(max_tokens=3))
    model = FakeModel(sched)
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, model.run(out))
    states = {g.request_id: g.state for g in (*sched.running, *sched.waiting, *sched.swapped)}
    assert set(states.values()) == {
        SequenceStatus.RUNNING,
        SequenceStatus.WAITING,
        SequenceStatus.SWAPPED,
    }
    for rid in list(states):
        assert sched.abort(rid)
    assert_all_free(sched)
    out = sched.schedule()
    assert sorted(g.request_id for g in out.finished) == sorted(states)
    assert not sched.has_unfinished()


# -------------------------------------------------------------------------- rejection
@pytest.mark.parametrize(
    ("prompt_len", "params", "needle"),
    [
        (32, RequestParams(), "max_model_len=32"),
        (31, RequestParams(n=9), "max_num_seqs=8"),
    ],
)
def test_request_that_can_never_fit_is_rejected_with_its_reason(prompt_len, params, needle):
    sched = make(block_size=4, num_gpu_blocks=64, max_num_seqs=8, max_model_len=32)
    g = sched.add_request("big", [1] * prompt_len, params)
    assert g.is_finished and g.finish_reason is FinishReason.REJECTED
    assert needle in g.reason_text and "rejected" in g.reason_text
    assert g.finished_seqs[0].finish_reason is FinishReason.REJECTED
    assert sched.num_waiting == 0 and sched.has_unfinished()
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("big", [1])
    out = sched.schedule()
    assert out.finished == [g] and out.is_empty
    assert not sched.has_unfinished()
    assert sched.stats().num_rejected == 1
    sched.add_request("big", [1])  # reported: the id may be used again


def test_prompt_larger_than_the_whole_kv_cache_is_rejected():
    sched = make(block_size=4, num_gpu_blocks=4, max_model_len=2048)
    g = sched.add_request("huge", [1] * 16)
    assert g.finish_reason is FinishReason.REJECTED
    assert "whole KV cache" in g.reason_text and "16 token slots" in g.reason_text
    ok = sched.add_request("fits", [1] * 15, RequestParams(max_tokens=None))
    drive(sched)
    # a sequence also stops when it would outgrow the cache, with reason length
    assert ok.finished_seqs[0].finish_reason is FinishReason.LENGTH
    assert ok.finished_seqs[0].num_tokens == 16


def test_group_too_big_for_the_cache_even_alone_ends_with_length():
    sched = make(block_size=2, num_gpu_blocks=6, max_model_len=12)
    g = sched.add_request("beam-wide", [1, 2, 3], RequestParams(n=3, max_tokens=8))
    model = FakeModel(sched)
    outs = drive(sched, model)
    assert g.is_finished and "do not fit in the KV cache" in g.reason_text
    assert all(s.finish_reason is FinishReason.LENGTH for s in g.finished_seqs)
    assert any(g in o.finished for o in outs)
    assert_all_free(sched)


# -------------------------------------------------------------------- forks and beams
def test_parallel_sampling_forks_share_blocks_then_copy_on_write():
    sched = make(block_size=4, num_gpu_blocks=4, max_model_len=32)
    g = sched.add_request("par", [1, 2, 3, 4, 5, 6], RequestParams(n=3, max_tokens=3))
    out = sched.schedule()
    assert plan(out) == [("par", 0, 6, True)]
    parent = out.scheduled[0].seq_id
    res = sched.update(out, {parent: [10, 11, 12]})
    assert res.forks == [(parent, parent + 1), (parent, parent + 2)]
    bm = sched.block_manager
    assert [bm.block_table(s.seq_id) for s in g.seqs] == [[0, 1]] * 3
    assert bm.gpu_pool.ref_count(0) == 3 and bm.gpu_pool.ref_count(1) == 3
    assert bm.stats().blocks_saved_by_sharing == 4
    assert [s.output_token_ids for s in g.seqs] == [[10], [11], [12]]
    assert [s.index for s in g.seqs] == [0, 1, 2]
    # Position 6 lies in the shared, partly filled block 1: two copies, the last writes in
    # place. Exactly the 2 free blocks are needed, so nothing is preempted.
    out = sched.schedule()
    assert out.preempted == []
    assert plan(out) == [("par", 6, 1, True)] * 3
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [bm.block_table(s.seq_id) for s in g.seqs] == [[0, 2], [0, 3], [0, 1]]
    sched.update(out, {s.seq_id: [20] for s in out.scheduled})
    out, res = step(sched)
    assert len(res.finished_groups) == 1 and g.is_finished
    assert_all_free(sched)


def test_beam_like_fork_and_prune():
    sched = make(block_size=4, num_gpu_blocks=16, max_model_len=32)
    g = sched.add_request("beam", [1, 2, 3], RequestParams(n=2, max_tokens=10))
    out = sched.schedule()
    s0 = out.scheduled[0].seq_id
    sched.update(out, {s0: [4]})  # one beam so far
    out = sched.schedule()
    res = sched.update(out, {s0: [5, 6]})  # branch
    s1 = res.forks[0][1]
    assert [s.output_token_ids for s in g.seqs] == [[4, 5], [4, 6]]
    out = sched.schedule()
    assert {s.seq_id for s in out.scheduled} == {s0, s1}
    with pytest.raises(ValueError, match="more than n=2"):
        sched.update(out, {s0: [1, 2], s1: [3]})
    res = sched.update(out, {s0: [], s1: [7]})  # prune beam 0
    assert res.finished_seqs[0].seq_id == s0
    assert res.finished_seqs[0].finish_reason is FinishReason.ABORTED
    assert not sched.block_manager.has_seq(s0)
    assert not g.is_finished
    out = sched.schedule()
    res = sched.update(out, {s1: []})  # prune the last one: the request ends
    assert res.finished_groups == [g] and g.is_finished and g.finish_reason is None
    assert_all_free(sched)
    assert [(s.index, s.output_token_ids) for s in g.all_seqs()] == [(0, [4, 5]), (1, [4, 6, 7])]


# -------------------------------------------------------------------- stop conditions
@pytest.mark.parametrize(
    ("params", "tokens", "n_out", "reason", "stop_reason"),
    [
        (RequestParams(max_tokens=10, eos_token_id=0), [3, 0, 4], 2, FinishReason.STOP, None),
        (
            RequestParams(max_tokens=10, eos_token_id=0, min_tokens=3),
            [0, 0, 0, 0],
            3,
            FinishReason.STOP,
            None,
        ),
        (
            RequestParams(max_tokens=4, eos_token_id=0, ignore_eos=True),
            [0] * 5,
            4,
            FinishReason.LENGTH,
            None,
        ),
        (RequestParams(max_tokens=10, stop_token_ids=[9, 8]), [1, 8], 2, FinishReason.STOP, 8),
        (
            RequestParams(max_tokens=10, stop_token_ids=[9], min_tokens=2),
            [9, 9],
            2,
            FinishReason.STOP,
            9,
        ),
        (RequestParams(max_tokens=3, eos_token_id=0), [1, 1, 0], 3, FinishReason.STOP, None),
        (RequestParams(max_tokens=None), [1] * 20, 6, FinishReason.LENGTH, None),  # max_model_len
    ],
)
def test_stop_conditions(params, tokens, n_out, reason, stop_reason):
    sched = make(block_size=4, num_gpu_blocks=16, max_model_len=10)
    g = sched.add_request("s", [1, 2, 3, 4], params)
    for tok in tokens:
        if g.is_finished:
            break
        step(sched, tok)
    (s,) = g.finished_seqs
    assert s.num_output_tokens == n_out
    assert s.finish_reason is reason and s.stop_reason == stop_reason
    assert_all_free(sched)


def test_finish_sequence_for_stop_strings():
    sched = make(block_size=4, num_gpu_blocks=16, max_model_len=64)
    g = sched.add_request("a", [1, 2], RequestParams(n=2, max_tokens=10))
    out = sched.schedule()
    res = sched.update(out, {out.scheduled[0].seq_id: [3, 4]})
    a, b = (s.seq_id for s in g.seqs)
    assert sched.finish_sequence(a, "stop") is False
    assert sched.finish_sequence(a, FinishReason.STOP) is False  # already finished: no-op
    assert sched.finish_sequence(b, FinishReason.LENGTH) is True
    assert g.is_finished and not sched.has_unfinished()
    with pytest.raises(ValueError, match="unknown sequence"):
        sched.finish_sequence(12345)
    assert res.forks == [(a, b)]
    assert_all_free(sched)
    out = sched.schedule()
    assert out.finished == []  # the caller ended it: not reported again


# ---------------------------------------------------------------------- prefix caching
def test_cached_prefix_blocks_count_as_computed():
    sched = make(block_size=4, num_gpu_blocks=16, max_model_len=64, enable_prefix_caching=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    sched.add_request("first", prompt, RequestParams(max_tokens=1))
    out, _ = step(sched)
    assert plan(out) == [("first", 0, 9, True)]
    sched.add_request("second", prompt, RequestParams(max_tokens=1))
    out, _ = step(sched)
    assert plan(out) == [("second", 8, 1, True)]  # two full blocks cached
    assert sched.stats().kv.prefix_cache_hits == 2
    assert_all_free(sched)


# --------------------------------------------------------------- scheduling ahead
def test_schedule_ahead_leaves_room_for_a_prefill_chunk():
    """Regression (found by the property test): can_schedule_ahead() used to count one free
    block per running sequence, but a sequence still in its chunked prefill takes a block per
    token here (block size 1), and schedule_ahead() then ran out of blocks. It now asks the
    block manager what each prefill chunk needs."""
    sched = AsyncScheduler(
        SchedulerConfig(
            block_size=1,
            num_gpu_blocks=9,
            max_num_seqs=2,
            max_num_batched_tokens=4,
            max_model_len=7,
            watermark=0.0,
        )
    )
    prompts = {"req0": [0], "req1": [0], "req2": [0, 0, 0, 0]}
    params = RequestParams(max_tokens=None)
    groups = {rid: sched.add_request(rid, p, params) for rid, p in prompts.items()}
    model = FakeModel(sched)
    assert drive_ahead(sched, model) > 0
    assert not model.corruptions
    assert_all_free(sched)
    for rid, prompt in prompts.items():
        assert actual_outputs(groups[rid]) == reference_outputs(rid, prompt, params, 7)


def test_plain_scheduler_has_no_schedule_ahead():
    """Scheduling ahead lives in AsyncScheduler only; the plain scheduler never has
    placeholders."""
    sched = make(block_size=4, num_gpu_blocks=8, max_model_len=16)
    assert not hasattr(sched, "schedule_ahead") and not hasattr(sched, "can_schedule_ahead")
    sched.add_request("a", [1, 2], RequestParams(max_tokens=3))
    drive(sched)
    assert_all_free(sched)
