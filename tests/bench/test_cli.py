"""pagedkv-bench's subcommands through the engine's `pagedkv` command (entry points
`pagedkv.bench_subcommands` and `pagedkv.subcommands`), and `pagedkv simulate` with the
simulator's own options (the documented command, which an `argparse.REMAINDER` once refused)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from pagedkv.engine.cli import build_parser, main

SIM = ["--rates", "4", "--num-requests", "20", "--policies", "paged,oracle"]


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_entry_points_are_declared_by_pagedkv_bench():
    bench = {ep.name: ep.value for ep in entry_points(group="pagedkv.bench_subcommands")}
    assert bench["throughput"] == "pagedkv.bench.throughput:register"
    assert bench["sharing"] == "pagedkv.bench.sharing:register"
    assert bench["serve"] == "pagedkv.bench.serve:register"
    top = {ep.name: ep for ep in entry_points(group="pagedkv.subcommands")}
    assert top["simulate"].value == "pagedkv.bench.sim:register"
    assert top["simulate"].dist.name == "pagedkv-bench"


def test_bench_help_lists_the_benchmarks():
    top = build_parser()._subparsers._group_actions[0].choices
    bench_help = top["bench"].format_help()
    for name in ("throughput", "sharing", "serve"):
        assert name in bench_help
    sim_help = top["simulate"].format_help()
    for flag in ("--workload", "--rates", "--policies", "--kv-gb", "--plot", "--output"):
        assert flag in sim_help


def test_simulate_takes_the_simulators_options(capsys, tmp_path):
    out_file = tmp_path / "sim.json"
    rc = main(["simulate", "--workload", "sharegpt", *SIM, "--seed", "2", "--output",
               str(out_file)])  # fmt: skip
    assert rc == 0
    res = _last_json(capsys.readouterr().out)
    assert res["setup"]["workload"] == "sharegpt" and res["setup"]["seed"] == 2
    assert res["setup"]["num_requests_per_rate"] == 20 and res["main_rate"] == 4.0
    assert set(res) >= {"paged", "oracle"} and "max" not in res and "pow2" not in res
    assert json.loads(out_file.read_text()) == res


def test_simulate_reports_bad_options_as_the_simulator_does(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--policies", "paged,buddy"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "pagedkv simulate" in err and "--policies: unknown" in err
    with pytest.raises(SystemExit):
        main(["simulate", "--workload", "nope"])
    assert "unknown workload" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


@pytest.mark.slow
def test_the_documented_command_runs_as_typed():
    """`pagedkv simulate --workload sharegpt ...` from the console script, as the docs show it;
    the command it records is that command line."""
    script = Path(sys.executable).with_name("pagedkv")
    if not script.exists():
        pytest.skip("no `pagedkv` console script next to this interpreter")
    args = ["simulate", "--workload", "sharegpt", *SIM]
    r = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = _last_json(r.stdout)
    assert res["command"] == "pagedkv " + " ".join(args)
    assert res["setup"]["workload"] == "sharegpt"
