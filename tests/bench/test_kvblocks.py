"""The block manager's benchmark (`python -m pagedkv.bench.kvblocks`) runs with tiny sizes and
ends with its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runs_with_tiny_sizes() -> None:
    args = [
        "--num-seqs", "8", "--seq-len", "40", "--block-size", "4", "--steps", "20",
        "--warmup", "2", "--fork-every", "3", "--prefix-tokens", "33", "--prefix-repeats", "3",
    ]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.bench.kvblocks", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    lines = out.strip().splitlines()
    assert any("decode step" in line for line in lines)
    command = "command: python -m pagedkv.bench.kvblocks --num-seqs 8"
    assert any(line.startswith(command) for line in lines)
    figures = json.loads(lines[-1])
    assert figures["decode_step_us"] > 0 and figures["prefix_lookup_us"] > 0
    assert figures["num_seqs"] == 8 and figures["prefix_blocks"] == 8
    assert figures["copies_per_step"] > 0  # forks led to copy-on-write
