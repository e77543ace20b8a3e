"""Shared test configuration: the `gpu` marker, Hypothesis profiles, one CPU thread per
test worker."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# `./dev test` runs the suite in two pytest-xdist workers on a 2-core machine: one thread each
# (and in the servers and engine cores they start, which inherit it) keeps torch's OpenMP
# threads from fighting over the cores. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("dev", deadline=None, max_examples=50)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _worker_group(item: pytest.Item) -> str:
    """Which tests one xdist worker runs together: a file's tests (its module-scoped engine or
    server starts once), and every server test (their session-scoped servers, a GB or two
    each, then start once, not once per worker)."""
    path = Path(str(item.path)).resolve().relative_to(ROOT).as_posix()
    return "servers" if path.startswith("tests/server/") else path


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist") and config.getvalue("dist") == "loadgroup":
        for item in items:
            item.add_marker(pytest.mark.xdist_group(_worker_group(item)))
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
