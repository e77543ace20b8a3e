"""`pagedkv.bench.env`: the one record of where a benchmark ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.bench import env

ROOT = Path(__file__).resolve().parents[2]


def test_environment_records_versions_commit_and_command(monkeypatch):
    monkeypatch.delenv("PAGEDKV_COMMIT", raising=False)
    info = env.environment(argv=["--rates", "2", "--plot", "a b.png"], prog="python -m x.y")
    assert info["command"] == "python -m x.y --rates 2 --plot 'a b.png'"  # quoted: re-typeable
    assert info["python"] == ".".join(map(str, sys.version_info[:3]))
    packages = info["packages"]
    for dist in ("kvblocks", "pagedkv-scheduler", "pagedkv-engine", "pagedkv-bench"):
        assert packages[dist].count(".") == 2, packages
    # this checkout's commit, the same as git's (with -dirty for local changes)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    if not head:
        pytest.skip("not a git checkout")
    assert info["commit"].removesuffix("-dirty") == head


def test_pagedkv_commit_wins(monkeypatch):
    monkeypatch.setenv("PAGEDKV_COMMIT", "abc1234")
    assert env.git_commit() == "abc1234"
    assert env.environment()["commit"] == "abc1234"


def test_settings_that_change_a_run_are_recorded(monkeypatch):
    """Two runs that differ only in ``PAGEDATTN_PDL`` (or an fp8 switch) have the same command
    line: the environment record tells them apart; unrelated variables stay out."""
    for key in [k for k in os.environ if k.startswith(env.SETTING_PREFIXES)]:
        monkeypatch.delenv(key)
    assert "settings" not in env.environment()
    monkeypatch.setenv("PAGEDATTN_PDL", "0")
    monkeypatch.setenv("PAGEDKV_FP8_FAST_ACCUM", "1")
    monkeypatch.setenv("PAGEDKV_MATMUL_16BIT_MAX_ROWS", "0")
    monkeypatch.setenv("PAGEDKV_UNRELATED", "x")
    assert env.environment()["settings"] == {"PAGEDATTN_PDL": "0", "PAGEDKV_FP8_FAST_ACCUM": "1",
                                             "PAGEDKV_MATMUL_16BIT_MAX_ROWS": "0"}  # fmt: skip


def test_torch_is_reported_once_loaded():
    import torch

    info = env.environment()
    assert info["torch"] == torch.__version__
    assert info["transformers"]  # installed in the test environment
    assert ("gpu" in info) == torch.cuda.is_available()
    assert env.hardware("cpu").startswith("CPU ")


def test_command_line_of_this_process(monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", ["/usr/bin/python3", "-m", "pagedkv.bench.sim", "--x"])
    assert env.command_line() == "python -m pagedkv.bench.sim --x"
    monkeypatch.setattr(sys, "orig_argv", ["/v/bin/python", "/v/bin/pagedkv", "bench", "serve"])
    monkeypatch.setattr(sys, "argv", ["/v/bin/pagedkv", "bench", "serve"])
    assert env.command_line() == "pagedkv bench serve"


def test_versions_from_a_checkout_on_the_path(monkeypatch):
    """Without installed metadata (the GPU machine puts the checkout on PYTHONPATH), versions
    are read from each package's __about__.py, without importing the package."""
    from importlib import metadata

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(env.importlib.metadata, "version", not_installed)
    versions = env.package_versions()
    about = (ROOT / "packages/server/src/pagedkv/server/__about__.py").read_text()
    assert f'"{versions["pagedkv-server"]}"' in about
    assert set(versions) == set(env.DISTRIBUTIONS)
