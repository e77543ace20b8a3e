"""The README example runs as written, and the benchmark runs (tiny sizes) and ends with JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "packages" / "kvblocks"


def test_readme_quick_usage_runs() -> None:
    text = (PKG / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README must keep its runnable example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


def test_changelog_mentions_this_version() -> None:
    import kvblocks

    assert f"## {kvblocks.__version__}" in (PKG / "CHANGELOG.md").read_text()


def test_bench_runs_with_tiny_sizes() -> None:
    args = [
        "--num-seqs", "8", "--seq-len", "40", "--block-size", "4", "--steps", "20",
        "--warmup", "2", "--fork-every", "3", "--prefix-tokens", "33", "--prefix-repeats", "3",
    ]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "kvblocks.bench", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    lines = out.strip().splitlines()
    assert any("decode step" in line for line in lines)
    figures = json.loads(lines[-1])
    assert figures["decode_step_us"] > 0 and figures["prefix_lookup_us"] > 0
    assert figures["num_seqs"] == 8 and figures["prefix_blocks"] == 8
    assert figures["copies_per_step"] > 0  # forks led to copy-on-write
