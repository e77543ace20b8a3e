"""The device-wait diagnosis scripts run on a GPU, where a session has a few minutes: each must
at least start, parse its options and, where it can, run through on the CPU first."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def _run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_step_windows_parse_and_bad_ones_are_refused():
    from step_trace import parse_windows

    assert parse_windows("16-24,2-5,7") == [(2, 5), (7, 7), (16, 24)]
    for bad in ("0-3", "5-2", "x"):
        with pytest.raises(ValueError):
            parse_windows(bad)


def test_step_trace_runs_its_windows_on_the_cpu(tmp_path):
    out = tmp_path / "trace.json"
    done = _run("scripts/step_trace.py", "--device", "cpu", "--kv-cache-gb", "0.1",
                "--num-prompts", "6", "--input-len", "12", "--output-len", "6",
                "--max-num-seqs", "4", "--steps", "1-2,4-5", "--output-json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    windows = json.loads(out.read_text())["windows"]
    assert [w["steps"] for w in windows] == [[1, 2], [4, 5]]
    assert all("by_name" in w and "longest" in w for w in windows)  # no CUDA calls on the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
@pytest.mark.parametrize("script", ["graph_first_replay.py", "overlap_probe.py"])
def test_gpu_only_probes_say_so_on_the_cpu(script):
    done = _run(f"scripts/{script}", "--device", "cpu")
    assert done.returncode == 1
    assert "no CUDA device" in done.stdout


def test_gate_up_silu_bench_parses_its_options():
    """``scripts/gate_up_silu_bench.py`` (the fused gate/up + SwiGLU kernel against the two ops,
    CUDA only) at least starts and names its options."""
    done = _run("scripts/gate_up_silu_bench.py", "--help", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--chain" in done.stdout and "--m" in done.stdout
