"""The tutorials' widget callbacks: set a control's value, check what the notebook shows.

The expectations are computed independently of the helper module: block counts from the
sequence lengths, the block manager's own block tables, the scheduler's own limits.
"""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("ipywidgets")

SPECS = [(5, 9), (3, 14), (9, 4), (2, 11)]


@pytest.fixture
def paging(helpers):
    demo = helpers.PagingDemo(
        [helpers.SeqSpec(p, o) for p, o in SPECS],
        block_size=4,
        num_gpu_blocks=32,
        contiguous_len=32,
    )
    return helpers.PagingWidget(demo)


def shown_tables(html: str) -> dict[int, list[int]]:
    """The block tables as the HTML view shows them: seq id -> physical block ids."""
    tables = {}
    for row in re.findall(r'<tr data-seq="(\d+)">(.*?)</tr>', html):
        seq, cells = int(row[0]), row[1]
        tables[seq] = [int(b) for b in re.findall(r"title=\"logical \d+ -> physical (\d+),", cells)]
    return tables


def test_paging_slider_moves_the_demo_and_redraws(paging):
    assert paging.snapshot.step == 0
    before = paging.tables.value
    for step in (3, 9, 14, 2, 0, 7):
        paging.slider.value = step
        assert paging.snapshot.step == step
        bm = paging.demo.manager
        shown = shown_tables(paging.tables.value)
        for seq, (prompt, output) in enumerate(SPECS):
            tokens = prompt + min(step, output)
            assert bm.num_slots(seq) == tokens
            # blocks on demand: exactly ceil(tokens / block_size) blocks
            assert len(bm.block_table(seq)) == math.ceil(tokens / 4)
            assert shown[seq] == bm.block_table(seq)
            assert f"{tokens} tokens" in paging.tables.value
    assert paging.tables.value != before


def test_paging_pool_view_marks_every_used_block(paging):
    paging.slider.value = 10
    bm = paging.demo.manager
    used = {b for seq in range(len(SPECS)) for b in bm.block_table(seq)}
    pool = paging.pool.value
    shown_used = {int(b) for b in re.findall(r'data-block="(\d+)" title="block \d+: seq', pool)}
    shown_free = {int(b) for b in re.findall(r'data-block="(\d+)" title="block \d+: free', pool)}
    assert shown_used == used
    assert shown_free == set(range(32)) - used
    assert bm.stats().gpu_used == len(used)


def test_paging_waste_is_bounded_by_one_block_per_sequence(paging, helpers):
    series = helpers.waste_curve(paging.demo)
    for used, paged, contiguous in zip(series["used"], series["paged"], series["contiguous"]):
        assert 0 <= paged - used < len(SPECS) * 4
        assert contiguous == 32 * len(SPECS)
    paging.slider.value = 14
    assert f"<td>{paging.snapshot.paged_waste} (" in paging.waste.value


def test_paging_demo_rejects_bad_input(helpers):
    with pytest.raises(ValueError, match="contiguous_len"):
        helpers.PagingDemo([helpers.SeqSpec(5, 10)], contiguous_len=8)
    with pytest.raises(ValueError, match="prompt_len"):
        helpers.PagingDemo([helpers.SeqSpec(0, 3)])


def test_paged_attention_check_agrees_with_sdpa_on_cpu(paging, helpers):
    torch = pytest.importorskip("torch")
    paging.slider.value = 8
    check = helpers.check_paged_attention(
        paging.demo, torch.device("cpu"), num_heads=8, num_kv_heads=2, head_dim=16
    )
    assert check.seq_lens == [paging.demo.manager.num_slots(s) for s in range(len(SPECS))]
    assert check.ok, check


REQUESTS = [
    ("A", 40, 12, 0),
    ("B", 8, 20, 0),
    ("C", 60, 10, 2),
    ("D", 12, 16, 3),
    ("E", 20, 8, 6),
]


@pytest.fixture
def sched_widget(helpers):
    reqs = [helpers.TimelineRequest(*r) for r in REQUESTS]
    return helpers.SchedulerWidget(reqs, max_num_batched_tokens=32, num_gpu_blocks=64)


def test_scheduler_budget_control_reruns_the_scheduler(sched_widget):
    w = sched_widget
    first_image, first_summary = w.image.value, w.summary.value
    assert max(w.timeline.batched_tokens) <= 32
    w.budget.value = 128
    assert w.timeline.budget == 128
    assert max(w.timeline.batched_tokens) <= 128
    assert max(w.timeline.batched_tokens) > 32  # the prompts now fit in fewer steps
    assert w.image.value != first_image and w.summary.value != first_summary
    assert "budget 128" in w.summary.value
    # every request computed its whole prompt and generated all its tokens
    for rid, prompt, max_tokens, _ in REQUESTS:
        computed = sum(step.get(rid, ("", 0))[1] for step in w.timeline.scheduled)
        assert computed >= prompt + max_tokens - 1
        assert rid in w.timeline.finish_step


def test_scheduler_chunked_prefill_splits_long_prompts(sched_widget):
    w = sched_widget
    chunks = [step["C"][1] for step in w.timeline.scheduled if step.get("C", ("",))[0] == "prefill"]
    assert len(chunks) >= 2 and sum(chunks) == 60  # 60 tokens under a 32-token budget
    w.budget.value = 128
    w.chunked.value = False
    chunks = [step["C"][1] for step in w.timeline.scheduled if step.get("C", ("",))[0] == "prefill"]
    assert chunks == [60]


def test_scheduler_small_memory_preempts_and_still_finishes(sched_widget):
    w = sched_widget
    assert w.timeline.num_preemptions == 0
    w.blocks.value = 24
    assert w.timeline.num_preemptions > 0
    assert set(w.timeline.finish_step) == {r[0] for r in REQUESTS}
    assert "preemptions" in w.summary.value


def test_scheduler_refused_setting_shows_the_message(sched_widget):
    w = sched_widget
    w.chunked.value = False  # budget 32 < max_model_len 128: the scheduler refuses
    assert w.timeline is None
    assert "max_num_batched_tokens" in w.error
    assert "pagedkv-error" in w.summary.value
    w.chunked.value = True
    assert w.error is None and w.timeline is not None


def test_simulation_rate_slider_reruns_every_policy(helpers):
    w = helpers.SimulationWidget(rates=(1.0, 6.0), num_requests=60)
    low = {p: r.avg_batched_requests for p, r in w.results.items()}
    before = w.table.value
    assert set(low) == {"paged", "oracle", "pow2", "max"}
    w.rate.value = 6.0
    high = {p: r.avg_batched_requests for p, r in w.results.items()}
    assert all(r.rate == 6.0 for r in w.results.values())
    assert w.table.value != before
    assert high["paged"] > low["paged"]  # more arrivals per second, bigger batches
    for p, r in w.results.items():
        assert (
            f'data-policy="{p}"><td><b>{p}</b></td><td>{r.avg_batched_requests:.1f}</td>'
            in w.table.value
        )


def test_prefix_sharing_slider_counts_blocks(helpers):
    system = list(range(1000, 1040))  # 40 shared tokens: 2 full blocks of 16 and 8 more
    prompts = [[*system, i, i + 1, i + 2] for i in range(5)]  # 43 tokens each
    w = helpers.PrefixSharingWidget(prompts, block_size=16)
    assert (w.with_cache["blocks"], w.without["blocks"]) == (3, 3)
    for k in (2, 5, 3):
        w.count.value = k
        # without caching every prompt takes ceil(43 / 16) = 3 blocks; with it the 2 full
        # system-prompt blocks are shared and each request adds its own last block
        assert w.without["blocks"] == 3 * k
        assert w.with_cache["blocks"] == 2 + k
        assert w.with_cache["cached_tokens"] == 32 * (k - 1)
        assert f"<td>with prefix caching</td><td>{2 + k}</td>" in w.view.value
        assert f"<td>without prefix caching</td><td>{3 * k}</td>" in w.view.value
    with pytest.raises(ValueError, match="at least one"):
        helpers.PrefixSharingWidget([])


@pytest.fixture(scope="module")
def kit(helpers):
    """The real engine on the embedded model (loaded once for these tests)."""
    torch = pytest.importorskip("torch")
    engine = pytest.importorskip("pagedkv.engine")
    llm = engine.LLM(
        device="cpu", block_size=8, num_gpu_blocks_override=64, num_cpu_blocks_override=16
    )
    return helpers.EngineKit(llm), torch


@pytest.mark.slow
def test_trace_widget_shows_the_copy_on_write_step(helpers, kit):
    kit, _ = kit
    from pagedkv.engine import SamplingParams

    prompt = kit.tokens("Write one sentence about a robot who learns to paint. The robot")
    assert len(prompt) % 8 != 0  # the last prompt block is partly filled, so it will be copied
    params = SamplingParams(n=4, temperature=0.9, max_tokens=4, seed=1)
    trace = helpers.EngineTrace(kit.engine()).run([("par", prompt, params)])
    full = len(prompt) // 8
    first = trace.records[0]
    assert (
        sum(len(t) for t, _, _ in first.tables["par"].values()) // len(first.tables["par"])
        == full + 1
    )
    (step,) = trace.copy_steps()[:1]
    rec = trace.records[step]
    assert len(rec.copies) == 3  # three of the four forked sequences copy; the last one owns it
    w = helpers.TraceWidget(trace)
    before = w.view.value
    w.slider.value = step
    assert w.view.value != before and w.record is rec
    for src, dst in rec.copies:
        assert f"block {src} → {dst}" in w.view.value
    # the full prompt blocks stay shared by all four sequences
    assert w.view.value.count("<sup>×4</sup>") == 4 * full
    assert rec.gpu_used == full + 4 and rec.blocks_without_sharing == 4 * (full + 1)
