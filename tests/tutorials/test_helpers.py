"""The tutorials' helper package: controls re-run the notebook's function and redraw, views
show exactly the blocks they are given, the device panel's arithmetic, honest timings, the
exercise checks, the /metrics poller. Expectations are computed independently of the helpers."""

from __future__ import annotations

import http.server
import re
import threading
from collections import Counter

import pytest

pytest.importorskip("ipywidgets")


def test_rerun_calls_the_function_again_on_every_change(helpers):
    calls = []

    def run(block_size, length, chunked):
        calls.append((block_size, length, chunked))
        if length > 30:
            raise ValueError(f"length {length} is too long")
        return f"<p>bs={block_size} len={length} chunked={chunked}</p>"

    w = helpers.Rerun(run, block_size=[8, 16], length=(1, 40, 1, 5), chunked=True)
    assert calls == [(8, 5, True)] and "bs=8 len=5" in w.view.value and w.runs == 1
    w.controls["block_size"].value = 16
    w.controls["length"].value = 12
    assert calls[-1] == (16, 12, True) and "bs=16 len=12" in w.view.value and w.runs == 3
    assert "block_size=16, length=12" in w.status.value
    w.controls["length"].value = 35  # the function refuses: its message is shown, nothing else
    assert w.error == "length 35 is too long" and "pagedkv-error" in w.view.value
    assert w.result is None and w.runs == 3
    w.controls["chunked"].value = False
    w.controls["length"].value = 3
    assert w.error is None and "chunked=False" in w.view.value
    with pytest.raises(ValueError, match="control 'x'"):
        helpers.Rerun(run, x="not a spec")


def test_rerun_raises_when_its_defaults_fail(helpers):
    """A notebook whose own defaults fail must stop "run all" (a KeyError in a GPU-only code
    path once showed as a red line in the widget while the notebook run passed)."""

    def run(n):
        return {"execute": 1.0}["launch" if n == 3 else "execute"]

    with pytest.raises(KeyError, match="launch"):
        helpers.Rerun(run, n=(1, 5, 1, 3))
    w = helpers.Rerun(run, n=(1, 5, 1, 2))
    w.controls["n"].value = 3  # a moved control: shown, not raised
    assert w.error == "KeyError: 'launch'" and "pagedkv-error" in w.view.value


def test_a_dropdown_whose_first_value_is_none_starts_selected(helpers):
    """("default", None) first: the dropdown shows it selected (ipywidgets reads value=None as
    no selection, and the browser's first change would then re-pick it and run nothing)."""
    calls = []
    w = helpers.Rerun(lambda mode: calls.append(mode) or "ok",
                      mode=[("default", None), ("recompute", "recompute")])
    control = w.controls["mode"]
    assert (control.index, control.label, control.value) == (0, "default", None)
    control.index = 1
    control.index = 0
    assert calls == [None, "recompute", None] and w.runs == 3


def test_rerun_draws_figures_and_lists(helpers):
    import matplotlib.pyplot as plt

    def run(n):
        fig, ax = plt.subplots()
        ax.plot(range(n))
        return ["<b>head</b>", fig]

    w = helpers.Rerun(run, n=(2, 9, 1, 3))
    assert w.view.value.startswith("<b>head</b><img") and "data:image/png;base64," in w.view.value
    before = w.view.value
    w.controls["n"].value = 9
    assert w.view.value != before


def test_player_shows_the_item_of_the_slider(helpers):
    w = helpers.Player(["a", "b", "c"], lambda s: f"<i>{s}</i>", start=1)
    assert w.view.value == "<i>b</i>"
    w.slider.value = 2
    assert w.view.value == "<i>c</i>" and w.index == 2
    numbered = helpers.Player(["a", "b", "c"], lambda s: s, start=1, first=1)  # engine steps 1-3
    assert (numbered.slider.min, numbered.slider.value, numbered.slider.max) == (1, 2, 3)
    numbered.slider.value = 1
    assert numbered.view.value == "a" and numbered.index == 0
    with pytest.raises(ValueError, match="at least one"):
        helpers.Player([], str)


def shown(html: str) -> dict[str, list[tuple[int, str, int]]]:
    """Rows of a block-table view: label -> [(block, slots 'n/bs', ref count)]."""
    rows = {}
    for label, cells in re.findall(r'<tr data-seq="([^"]+)">(.*?)</tr>', html):
        rows[label] = [
            (int(b), fill, int(ref or 1))
            for b, fill, ref in re.findall(r">(\d+)<sub>(\d+/\d+)</sub>(?:<sup>×(\d+)</sup>)?</td>", cells)
        ]
    return rows


def test_block_tables_show_ref_counts_from_the_tables(helpers):
    tables = {"a": ([0, 1, 5], 10), "b": ([0, 1, 6], 9), "c": ([0, 2], 7)}
    html = helpers.block_tables_html(tables, 4, copied_to=[5], new_blocks=[6])
    rows = shown(html)
    entries = Counter(b for t, _ in tables.values() for b in t)
    for label, (table, filled) in tables.items():
        assert [b for b, _, _ in rows[label]] == table
        assert [ref for _, _, ref in rows[label]] == [entries[b] for b in table]
        fills = [f"{max(0, min(4, filled - 4 * i))}/4" for i in range(len(table))]
        assert [f for _, f, _ in rows[label]] == fills
    assert html.count("outline:2px solid #c44e52") == 1 and html.count("outline:2px solid #000") == 1
    pool = helpers.pool_html(8, tables, 4)
    free = {int(b) for b in re.findall(r'data-block="(\d+)" title="block \d+: free"', pool)}
    assert free == set(range(8)) - set(entries)


def test_engine_step_view_names_every_block_of_the_step(helpers):
    from pagedkv.engine.step_record import ScheduledSeq, SeqBlocks, StepRecord

    def rec(step, scheduled, after, copies=(), forks=(), sampled=None):
        return StepRecord(step, tuple(scheduled), (), (), tuple(copies), (), sampled or {},
                          tuple(forks), (), 10, 16, 1, 0, 0, block_tables=tuple(after))  # fmt: skip

    before = rec(1, [ScheduledSeq(0, "r", 0, 13, True, True, (0, 1))],
                 [SeqBlocks(s, "r", 13, "gpu", (0, 1)) for s in range(3)], forks=[(0, 1), (0, 2)])  # fmt: skip
    now = rec(
        2,
        [ScheduledSeq(s, "r", 13, 1, False, True, t) for s, t in ((0, (0, 3)), (1, (0, 4)), (2, (0, 1)))],
        [SeqBlocks(0, "r", 14, "gpu", (0, 3)), SeqBlocks(2, "r", 14, "gpu", (0, 1)),
         SeqBlocks(5, "r", 14, "gpu", (0, 1))],
        copies=[(1, 3), (1, 4)], forks=[(2, 5)], sampled={0: [7], 1: [], 2: [8, 9]},
    )  # fmt: skip
    html = helpers.engine_step_html(before, now, 8)
    assert "copy-on-write: block 1→3, 1→4" in html
    assert "fork: seq 2 → new seq 5" in html and "dropped (pruned beams, blocks released): seq 1" in html
    part1, part2, part3 = re.split(r"<b>[23]\. ", html)
    assert {b for row in shown(part1).values() for b, _, _ in row} == {0, 1}
    assert {b for row in shown(part2).values() for b, _, _ in row} == {0, 1, 3, 4}
    after = shown(part3)
    assert after["r seq 5"] == [(0, "8/8", 3), (1, "6/8", 2)]  # shares seq 2's blocks
    assert "r seq 1" not in after


def test_device_panel_arithmetic(helpers):
    import torch

    cache = torch.zeros(2, 10, 4, 3, 8)  # [K/V, blocks, block size, kv heads, head dim], fp32
    panel = helpers.device_panel(torch.device("cpu"), kv_cache=cache, num_blocks=10, block_size=4,
                                 num_free_blocks=7, kernel_times={"k": helpers.Timing((0.002, 0.001, 0.003), "host clock")})  # fmt: skip
    text = re.sub(r"<[^>]+>", " ", panel.data)
    per_token = 2 * 3 * 8 * 4  # K and V, 3 heads of 8 floats
    assert f"{per_token:,} B" in text
    assert "3 used, 7 free of 10 (30% used)" in text
    assert "7.5 KiB" in text  # the tensor: 10 blocks * 4 tokens * 192 B
    assert "2 ms (1–3, 3 runs) [host clock]" in text


def test_time_it_warms_up_then_times_each_repeat(helpers):
    import torch

    calls = []
    t = helpers.time_it(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeats=4)
    assert len(calls) == 6 and len(t.samples) == 4 and t.low <= t.median <= t.high
    with pytest.raises(ValueError, match="repeats"):
        helpers.time_it(lambda: None, torch.device("cpu"), repeats=0)
    order = []
    got = helpers.time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                   torch.device("cpu"), warmup=1, repeats=3)  # fmt: skip
    assert order == ["a", "b"] + ["a", "b"] * 3 and all(len(v.samples) == 3 for v in got.values())
    fast, slow = helpers.Timing((1.0, 2.0), "c"), helpers.Timing((2.5, 3.0), "c")
    assert fast.clearly_below(slow) and not slow.clearly_below(fast)
    assert not helpers.Timing((1.0, 2.6), "c").clearly_below(slow)
    # one slow run among five does not make two clearly different timings alike
    kernel = helpers.Timing((1.4e-3, 1.5e-3, 1.44e-3, 1.46e-3, 90e-3), "c")
    loop = helpers.Timing((64e-3, 65e-3, 66e-3, 65.5e-3, 64.5e-3), "c")
    assert kernel.quartiles() == (1.44e-3, 1.5e-3)
    assert kernel.clearly_below(loop) and not loop.clearly_below(kernel)
    assert helpers.Timing((2.0,), "c").quartiles() == (2.0, 2.0)


def test_checking_turns_any_failure_into_not_solved(helpers, capsys):
    not_solved = r"exercise 3\.2 is not solved yet \(AssertionError: off by one"
    with pytest.raises(helpers.NotSolved, match=not_solved), helpers.checking("3.2"):
        assert 1 == 2, "off by one"
    with pytest.raises(helpers.NotSolved, match="TypeError"), helpers.checking("3.2"):
        int("1") + None
    with helpers.checking("3.2"):
        pass
    assert "✓ exercise 3.2 solved" in capsys.readouterr().out


METRICS = """# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{model_name="m"} 2.0
"""


@pytest.fixture
def metrics_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_metrics_poller_follows_the_server(helpers, metrics_server):
    pytest.importorskip("prometheus_client")
    assert helpers.scrape(metrics_server) == {
        "vllm:num_requests_running": 3.0, "vllm:gpu_cache_usage_perc": 0.5,
        "vllm:num_preemptions_total": 2.0,
    }  # fmt: skip
    with helpers.MetricsPoller(metrics_server, interval_s=0.01) as poller:
        threading.Event().wait(0.05)
        during = poller.snapshot()  # while the thread appends: whole scrapes only
        assert len({len(v) for v in during.values()}) == 1 and during["t"]
        during["t"].append(-1.0)  # a copy: the poller's own lists are untouched
        threading.Event().wait(0.05)
    s = poller.series
    assert -1.0 not in s["t"]
    assert len(s["t"]) >= 2 and s["t"] == sorted(s["t"])
    assert set(s["running"]) == {3.0} and set(s["kv_usage"]) == {0.5} and set(s["waiting"]) == {0.0}
    assert set(s["preemptions"]) == {2.0}
    with pytest.raises(ValueError, match="interval_s"):
        helpers.MetricsPoller(metrics_server, interval_s=0)


def test_plots_draw(helpers):
    figs = [
        helpers.plot_waste([0, 1, 2], [4, 5, 6], [8, 8, 8], [20, 20, 20]),
        helpers.plot_states({"a": ["prefill", "decode", None], "b": ["waiting", "swapped", "decode"]},
                            [(1, "b")], extra={"blocks": [1, 2, 2]}),
        helpers.plot_timeline([{"a": ("prefill", 8)}, {"a": ("decode", 1)}], [{"b": "waiting"}, {}],
                              [[], []], 8, ["a", "b"]),
        helpers.plot_metrics({"t": [0, 1], "running": [1, 2], "waiting": [0, 1], "swapped": [0, 0],
                              "kv_usage": [0.1, 0.9], "preemptions": [0, 1]},
                             preemptions_label="preemptions in this burst"),
    ]
    assert figs[-1].axes[-1].get_ylabel() == "preemptions in this burst"
    for fig in figs:
        assert helpers.figure_html(fig).startswith('<img class="pagedkv-figure" src="data:image/png;base64,')


def test_engine_panel_counts_the_blocks_of_the_step_it_is_given(helpers):
    """After a run every block is free again: a panel under a step's view counts that step's."""
    from types import SimpleNamespace

    import torch

    engine = SimpleNamespace(
        device=torch.device("cpu"),
        runner=SimpleNamespace(kv_cache=torch.zeros(2, 8, 4, 2), swap_cache=None),
        args=SimpleNamespace(block_size=4),
        model_config=SimpleNamespace(name="tiny"),
        get_stats=lambda: SimpleNamespace(num_gpu_blocks=8, gpu_kv_usage=0.0),
    )
    now = helpers.engine_panel(engine).data
    assert "0 used, 8 free of 8" in now
    step = SimpleNamespace(step=5, num_gpu_blocks=8, num_free_blocks=2)
    then = helpers.engine_panel(engine, record=step).data
    assert "6 used, 2 free of 8 (75% used)" in then and "after step 5" in then
