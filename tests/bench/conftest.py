"""Servers for `bench serve`'s end-to-end tests, started only when a test asks for one.

The launch helpers are the server tests' own (`tests/server/conftest.py`): `pagedkv serve` runs
exactly as a user runs it, and `pagedkv bench serve` measures it over loopback HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..server.conftest import RunningServer, launch_server, pagedkv_command, stop_server, wait_ready

__all__ = ["RunningServer", "pagedkv_command"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """`pagedkv serve` on the embedded model (stopped after its module: a server holds a GB
    or two that the rest of the session needs)."""
    launch = launch_server(tmp_path_factory.mktemp("bench-server") / "server.log",
                           "--kv-cache-gb", "0.5")
    try:
        yield wait_ready(launch)
    finally:
        stop_server(launch.process)


@pytest.fixture(scope="module")
def tokfree_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """`pagedkv serve --skip-tokenizer-init`: the embedded model served on token ids alone (the
    way the GPU benchmarks serve bundled shape-only configs, which have no tokenizer)."""
    log = tmp_path_factory.mktemp("bench-tokfree") / "tokfree.log"
    launch = launch_server(log, "--skip-tokenizer-init", "--kv-cache-gb", "0.25")
    try:
        yield wait_ready(launch)
    finally:
        stop_server(launch.process)


@pytest.fixture(scope="session", autouse=True)
def _sharegpt_length_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The real ShareGPT workload caches token counts on disk: keep the tests' cache in a
    fresh folder (one tokenization per session), not in the user's home."""
    import os

    folder = tmp_path_factory.mktemp("pagedkv-cache")
    old = os.environ.get("PAGEDKV_CACHE_DIR")
    os.environ["PAGEDKV_CACHE_DIR"] = str(folder)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PAGEDKV_CACHE_DIR", None)
        else:
            os.environ["PAGEDKV_CACHE_DIR"] = old
