"""Bad inputs get a ValueError that says what to do, and change nothing."""

from __future__ import annotations

import pytest
from sched_harness import FakeModel, make

from pagedkv.scheduler import (
    PreemptionMode,
    RequestParams,
    Scheduler,
    SchedulerConfig,
)


def snapshot(sched: Scheduler):
    """Everything observable about a scheduler, deep-copied into comparable values."""

    def group(g):
        return (
            g.request_id,
            g.state,
            g.finish_reason,
            g.num_preemptions,
            tuple(
                (s.seq_id, s.index, tuple(s.token_ids), s.num_computed_tokens, s.status)
                for s in g.all_seqs()
            ),
        )

    st = sched.stats()
    return (
        sched.block_manager.debug_snapshot(),
        [group(g) for g in sched.running],
        [group(g) for g in sched.waiting],
        [group(g) for g in sched.swapped],
        [g.request_id for g in sched._finished_pending],
        sched._next_seq_id,
        sched._next_arrival,
        (st.num_preemptions, st.prompt_tokens, st.generation_tokens, st.num_rejected),
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"num_gpu_blocks": 8, "block_size": 12}, "power of two"),
        ({"num_gpu_blocks": 8, "block_size": 0}, "block_size"),
        ({"num_gpu_blocks": 8, "num_cpu_blocks": -1}, "num_cpu_blocks"),
        ({"num_gpu_blocks": 8, "max_num_seqs": 0}, "max_num_seqs"),
        ({"num_gpu_blocks": 8, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"num_gpu_blocks": 8, "max_model_len": 1}, "max_model_len"),
        ({"num_gpu_blocks": 8.0}, "num_gpu_blocks"),
        ({"num_gpu_blocks": True}, "num_gpu_blocks"),
        ({"num_gpu_blocks": 8, "enable_chunked_prefill": 1}, "enable_chunked_prefill"),
        (
            {"num_gpu_blocks": 8, "enable_chunked_prefill": False, "max_num_batched_tokens": 100},
            "whole prompt must fit",
        ),
        ({"num_gpu_blocks": 8, "preemption_mode": "drop"}, "preemption_mode"),
        ({"num_gpu_blocks": 8, "preemption_mode": "swap"}, "num_cpu_blocks > 0"),
        ({"num_gpu_blocks": 8, "watermark": 1.0}, "watermark"),
        ({"num_gpu_blocks": 8, "watermark": -0.1}, "watermark"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_config_defaults_and_mode_parsing():
    cfg = SchedulerConfig(num_gpu_blocks=100, num_cpu_blocks=4, preemption_mode="swap")
    assert cfg.preemption_mode is PreemptionMode.SWAP
    assert (cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (16, 256, 2048)
    assert cfg.max_model_len == 2048 and cfg.enable_chunked_prefill
    assert cfg.watermark_blocks == 1 and cfg.num_gpu_slots == 1600
    with pytest.raises(ValueError, match="SchedulerConfig"):
        Scheduler({"num_gpu_blocks": 8})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "n must be"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": "ab"}, "stop_token_ids"),
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_request_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RequestParams(**kwargs)


def _busy_scheduler():
    """A scheduler with requests in every state (running, waiting, swapped) mid-run."""
    sched = make(
        block_size=4, num_gpu_blocks=4, num_cpu_blocks=8, max_model_len=32, preemption_mode="swap"
    )
    sched.add_request("a", [1, 2, 3, 4], RequestParams(max_tokens=10))
    sched.add_request("b", [5, 6], RequestParams(n=2, max_tokens=10))
    sched.add_request("c", list(range(8)), RequestParams(max_tokens=10))
    model = FakeModel(sched)
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, model.run(out))
    sched.add_request("w", [1])
    assert sched.num_running and sched.num_swapped and sched.num_waiting
    return sched, model


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("a", [1]), "already in use"),
        (("", [1]), "non-empty str"),
        ((7, [1]), "non-empty str"),
        (("x", []), "prompt is empty"),
        (("x", "hello"), "tokenize first"),
        (("x", [1, -1]), "ints >= 0"),
        (("x", [1, 2.0]), "ints >= 0"),
        (("x", [True]), "ints >= 0"),
        (("x", 5), "iterable of ints"),
        (("x", [1], {"n": 2}), "RequestParams"),
        (("x", [1], None, "now"), "arrival_time"),
        (("x", [1], None, None, ["unhashable"]), "hashable"),
    ],
)
def test_bad_add_request_changes_nothing(args, match):
    sched, _ = _busy_scheduler()
    before = snapshot(sched)
    with pytest.raises(ValueError, match=match):
        sched.add_request(*args)
    assert snapshot(sched) == before


def _bad_samples(out):
    sampled = [s.seq_id for s in out.scheduled if s.do_sample]
    first = sampled[0]
    every = {i: [3] for i in sampled}
    return [
        ({i: [3] for i in sampled[1:]}, "no entry for sequence"),
        ({**every, 99999: [3]}, "not scheduled with do_sample"),
        ({**every, first: [3.0]}, "Python ints"),
        ({**every, first: [True]}, "Python ints"),
        ({**every, first: [-3]}, "negative"),
        ({**every, first: 3}, "list of token ids"),
        ({**every, first: "3"}, "list of token ids"),
        ({**every, first: [1, 2, 3]}, "more than n=1"),
        ([3], "mapping"),
    ]


def test_bad_update_changes_nothing():
    sched, model = _busy_scheduler()
    out = sched.schedule()
    assert out.num_samples >= 2
    before = snapshot(sched)
    for samples, match in _bad_samples(out):
        with pytest.raises(ValueError, match=match):
            sched.update(out, samples)
        assert snapshot(sched) == before, match
    with pytest.raises(RuntimeError, match="update"):
        sched.schedule()  # the output was not applied yet
    assert snapshot(sched) == before
    good = model.run(out)
    sched.update(out, good)
    after = snapshot(sched)
    with pytest.raises(ValueError, match="already passed"):
        sched.update(out, good)
    assert snapshot(sched) == after
    new = sched.schedule()
    with pytest.raises(ValueError, match="latest schedule"):
        sched.update(out, good)  # stale output
    sched.update(new, model.run(new))


def test_bad_finish_sequence_changes_nothing():
    sched, _ = _busy_scheduler()
    seq_id = sched.running[0].seqs[0].seq_id
    before = snapshot(sched)
    with pytest.raises(ValueError, match="reason must be"):
        sched.finish_sequence(seq_id, "done")
    with pytest.raises(ValueError, match="only for requests that can never run"):
        sched.finish_sequence(seq_id, "rejected")
    with pytest.raises(ValueError, match="unknown sequence"):
        sched.finish_sequence(10**6)
    assert snapshot(sched) == before


def test_an_empty_output_needs_no_update():
    sched = make(block_size=4, num_gpu_blocks=8, max_model_len=16)
    out = sched.schedule()
    assert out.is_empty and out.num_samples == 0
    sched.add_request("a", [1])
    out = sched.schedule()  # allowed: nothing was waiting for samples
    assert [s.request_id for s in out.scheduled] == ["a"]
