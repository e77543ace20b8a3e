"""Shared test configuration: the `gpu` marker, Hypothesis profiles, one CPU thread per
test worker."""

from __future__ import annotations

import importlib.util
import os

# `./dev test` runs the suite in two pytest-xdist workers on a 2-core machine: one thread each
# (and in the servers and engine cores they start, which inherit it) keeps torch's OpenMP
# threads from fighting over the cores. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import pytest
from hypothesis import HealthCheck, settings

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


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` (a file's tests run in one worker, so its module-scoped engine or
    server starts once), except that every server test goes to the same worker: their
    session-scoped servers, a GB or two each, then start once, not once per worker."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ServerTestsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "tests/server/" if path.startswith("tests/server/") else path

    return ServerTestsTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
