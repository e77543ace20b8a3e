"""The benchmark's CPU smoke run works end to end and ends with one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KEYS = (
    "copy_bw_TBps",
    "decode_bw_frac_b64_c4k",
    "decode_vs_sdpa_b64_c4k",
    "decode_bw_frac_b1_c32k",
    "prefill_vs_sdpa_4k",
)


@pytest.mark.slow
def test_bench_quick_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.bench.kernels", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in KEYS:
        assert key in summary
    assert summary["quick"] is True and summary["copy_bw_TBps"] > 0
    assert summary["decode"] and summary["prefill"]
    for row in summary["decode"]:
        assert row["us"] > 0 and row["rel_err_vs_sdpa"] < 1e-4
    for row in summary["prefill"]:  # ours and the chosen SDPA variant, timed in turn
        lo, hi = row["vs_sdpa_interleaved_range"]
        assert 0 < lo <= row["vs_sdpa_interleaved"] <= hi
    assert any("B" in line and "ctx" in line for line in lines), "no readable table"
    ops = {row["op"] for row in summary["fused"]}
    assert ops == {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding"}
    for row in summary["fused"]:
        # On CPU both sides are the torch composition: bit-identical by construction.
        assert row["us"] > 0 and row["vs_unfused"] > 0 and row["exact_frac"] == 1.0
    assert any(line.startswith("fused_add_rms_norm") for line in lines), "no fused table"
