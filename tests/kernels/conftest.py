"""Shared fixtures of the kernel tests.

Every test that takes a ``target`` runs on each backend: the torch path on CPU, the Triton
kernels in Triton's interpreter on CPU (small sizes), and, marked ``gpu``, the compiled Triton
kernels and the torch path on CUDA at full sizes. Every test draws a fresh random seed, prints
it, and puts it in its failure messages; ``PAGEDATTN_TEST_SEED=<seed>`` replays one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagedattn_kernels.testing import fresh_seed


@dataclass(frozen=True)
class Target:
    device: str
    backend: str
    full: bool  # full sizes (GPU) or small ones (CPU, interpreter)

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


TARGETS = [
    pytest.param(Target("cpu", "torch", False), id="cpu-torch"),
    pytest.param(Target("cpu", "triton", False), id="cpu-triton-interpreted"),
    pytest.param(Target("cuda", "triton", True), id="cuda-triton", marks=pytest.mark.gpu),
    pytest.param(Target("cuda", "torch", True), id="cuda-torch", marks=pytest.mark.gpu),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "target" in metafunc.fixturenames:
        metafunc.parametrize("target", TARGETS)


@pytest.fixture
def seed() -> int:
    value = fresh_seed()
    print(f"seed={value} (replay with PAGEDATTN_TEST_SEED={value})")
    return value


def _openblas_thread_setters() -> list[tuple[object, object]]:
    """(set, get) functions of every OpenBLAS loaded in this process (numpy's among them)."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {
                line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line
            }
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    found.append((setter, getter))
                    break
            else:
                continue
            break
    return found


@pytest.fixture(autouse=True, scope="module")
def _one_blas_thread():
    """Triton's interpreter runs each tl.dot as a small numpy matmul; numpy's multi-threaded
    OpenBLAS makes those up to hundreds of times slower on a busy 2-core machine (its threads
    spin against each other). One BLAS thread while these tests run; restored afterwards."""
    import numpy  # noqa: F401  (make sure its OpenBLAS is loaded)

    setters = _openblas_thread_setters()
    saved = [getter() for _, getter in setters]
    for setter, _ in setters:
        setter(1)
    yield
    for (setter, _), n in zip(setters, saved):
        setter(n)
