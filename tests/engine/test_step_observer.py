"""The public step observer (`LLMEngine.add_step_observer`): what each `StepRecord` says agrees
with the block manager's rules checked independently here (blocks on demand, ref counts equal
table entries, forks share every block, copy-on-write destinations are private, free counts),
`block_tables=True` adds the tables after the step, observing changes no output, and a removed
observer is not called again. On the real embedded model, on the CPU."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from pagedkv.engine.arg_utils import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampling_params import SamplingParams

PROMPT = "Write one sentence about a robot who learns to paint. The robot"


@pytest.fixture(scope="module")
def make_engine(embedded_model):
    def make(**overrides: Any) -> LLMEngine:
        opts: dict[str, Any] = dict(device="cpu", block_size=8, num_gpu_blocks_override=64,
                                    num_cpu_blocks_override=32, seed=0)  # fmt: skip
        opts.update(overrides)
        return LLMEngine(EngineArgs(**opts), model=embedded_model)

    return make


def run(engine: LLMEngine, requests, *, tables: bool = True):
    records, plain, finals = [], [], {}
    remove = engine.add_step_observer(records.append, block_tables=tables)
    engine.add_step_observer(plain.append)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [c.token_ids for c in out.outputs]
    remove()
    return records, plain, finals


def check_consistent(records, block_size: int) -> None:
    prev = None
    for rec in records:
        gpu = [s for s in rec.block_tables if s.location == "gpu"]
        cpu = [s for s in rec.block_tables if s.location == "cpu"]
        for s in rec.block_tables:  # blocks on demand
            assert len(s.block_table) == math.ceil(s.num_slots / block_size), s
        gpu_blocks = {b for s in gpu for b in s.block_table}
        assert rec.num_free_blocks == rec.num_gpu_blocks - len(gpu_blocks)
        assert rec.num_free_cpu_blocks == rec.num_cpu_blocks - len({b for s in cpu for b in s.block_table})
        after = {s.seq_id: s.block_table for s in rec.block_tables}
        for parent, child in rec.forks:  # a forked child shares every block of its parent
            assert after[child] == after[parent]
        used = Counter(b for s in rec.scheduled for b in s.block_table)
        for src, dst in rec.blocks_to_copy:  # the copy is private; the source was shared before
            assert used[dst] == 1
            assert prev is not None
            assert sum(src in s.block_table for s in prev.block_tables if s.location == "gpu") > 1
        for s in rec.scheduled:  # the forward pass covers the positions it computes
            assert len(s.block_table) == math.ceil((s.start + s.num_tokens) / block_size)
        prev = rec


def test_parallel_sampling_records(make_engine):
    engine = make_engine()
    n = 3
    params = SamplingParams(n=n, temperature=0.9, max_tokens=5, seed=3)
    records, plain, finals = run(engine, [("par", PROMPT, params)])
    assert plain == records  # one record for every observer
    prompt_len = len(engine.get_tokenizer()(PROMPT)["input_ids"])
    assert prompt_len % 8, "the test needs a partly filled last prompt block"
    first = records[0]
    assert first.num_prefill_tokens == prompt_len and len(first.forks) == n - 1
    assert len(first.block_tables) == n
    assert len({s.block_table for s in first.block_tables}) == 1  # all share the prompt's blocks
    copies = [p for r in records for p in r.blocks_to_copy]
    assert len(copies) == n - 1  # all but the last writer copy the shared partly filled block
    check_consistent(records, 8)
    assert records[-1].finished == ("par",) and records[-1].block_tables == ()
    assert [r.step for r in records] == list(range(records[0].step, records[0].step + len(records)))
    # observing changes nothing: the same seeded outputs without an observer
    other = make_engine()
    other.add_request("par", PROMPT, params)
    outs = {}
    while other.has_unfinished_requests():
        for o in other.step():
            outs[o.request_id] = [c.token_ids for c in o.outputs]
    assert outs["par"] == finals["par"]


def test_beam_search_and_swap_records(make_engine):
    engine = make_engine()
    beam = SamplingParams(n=2, best_of=4, use_beam_search=True, max_tokens=5, temperature=0.0)
    records, _, _ = run(engine, [("beam", PROMPT, beam)])
    check_consistent(records, 8)
    assert any(not toks for r in records for toks in r.sampled.values())  # a pruned beam
    swap = make_engine(block_size=16, num_gpu_blocks_override=5, preemption_mode="swap")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["List three facts about the moon.", "Explain why the sky is blue.",
               "Write a haiku about autumn.", "Give two tips for learning a language."]  # fmt: skip
    records, _, _ = run(swap, [(f"r{i}", p, greedy) for i, p in enumerate(prompts)])
    check_consistent(records, 16)
    out_step = next(r for r in records if r.blocks_to_swap_out)
    on_cpu = [s for s in out_step.block_tables if s.location == "cpu"]
    assert on_cpu and {s.request_id for s in on_cpu} <= {rid for rid, _ in out_step.preempted}
    assert out_step.num_free_cpu_blocks == out_step.num_cpu_blocks - len(out_step.blocks_to_swap_out)


def test_tables_only_when_asked_and_removal(make_engine):
    engine = make_engine()
    records, plain = [], []
    remove_tables = engine.add_step_observer(records.append, block_tables=True)
    remove_plain = engine.add_step_observer(plain.append)
    remove_tables()
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert records == [] and plain and all(r.block_tables == () for r in plain)
    remove_plain()
    assert not engine.observed


def test_async_scheduling_steps_are_observed(make_engine):
    engine = make_engine(async_scheduling=True)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    records, _, _ = run(engine, [("a", PROMPT, greedy), ("b", "Hi", greedy)])
    assert records and all("wait" in r.timings for r in records[1:])
    check_consistent(records, 8)


def test_the_step_trace_counts_every_prompt_token_and_decode(make_engine, tmp_path, monkeypatch):
    """`PAGEDKV_STEP_TRACE`: one JSON line per step; over a run, the prefill tokens add up to
    the prompts and the decode rows to every output token after the first (which the last
    prefill chunk samples); a chunked prefill spreads over several lines."""
    import json

    from pagedkv.engine.core.step_trace import ENV_VAR, trace_from_env

    engine = make_engine(max_num_batched_tokens=16, enable_chunked_prefill=True)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert trace_from_env(engine) is None
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV_VAR, str(path))
    trace = trace_from_env(engine)
    prompts = [[1, *range(100, 130)], [1, 5, 6, 7]]  # 31 tokens: two chunks of 16 at most
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    trace.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == sorted({x["step"] for x in lines})
    assert sum(x["prefill_tokens"] for x in lines) == sum(map(len, prompts))
    assert sum(x["prefill_tokens"] > 0 for x in lines) >= 2  # chunked
    assert sum(x["decode"] for x in lines) == len(prompts) * (params.max_tokens - 1)
    assert all(x["prefill_tokens"] <= 16 for x in lines)
    assert all(("execute" in x) or ("wait" in x) for x in lines)  # the step's phases, in ms
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)


def test_the_core_profile_reports_a_window_of_iterations(tmp_path, monkeypatch):
    """`PAGEDKV_CORE_PROFILE=<path>:<skip>:<count>`: torch.profiler over the `count` loop
    iterations after the first `skip`, then a report of the longest host calls and a Chrome
    trace."""
    import torch

    from pagedkv.engine.core.step_trace import PROFILE_ENV_VAR, profile_from_env

    monkeypatch.delenv(PROFILE_ENV_VAR, raising=False)
    assert profile_from_env() is None
    path = tmp_path / "core_profile.txt"
    monkeypatch.setenv(PROFILE_ENV_VAR, f"{path}:3:2")
    profile = profile_from_env()
    x = torch.ones(64, 64)
    for i in range(1, 7):
        if i == 4:
            torch.mm(x, x)  # inside the window (iterations 4 and 5)
        profile.tick()
        assert path.exists() == (i >= 5)
    profile.close()  # nothing left to close
    report = path.read_text()
    assert report.startswith("longest single host calls") and "aten::mm" in report
    assert (tmp_path / "core_profile.txt.json").stat().st_size > 0
