"""Fixtures of the tutorial tests: the notebook runner (scripts/run_tutorials.py), a Jupyter
kernel bound to this interpreter, and the helper package as the notebooks import it."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "tutorials"


def _load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_tutorials", ROOT / "scripts" / "run_tutorials.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def runner() -> ModuleType:
    """``scripts/run_tutorials.py``: executes notebooks with their exercises checked."""
    return _load_runner()


@pytest.fixture(scope="session")
def kernel_name(runner) -> Iterator[str]:
    """A kernel spec for this interpreter in a temporary Jupyter path (nothing registered),
    and the tutorials' small-size switch on: the test suite runs the quick version."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDKV_TUTORIAL_SMALL", "1")
        with runner.kernel_env() as name:
            yield name


@pytest.fixture(scope="session")
def helpers() -> ModuleType:
    """The tutorials' helper package, imported from tutorials/ like the notebooks do."""
    if str(TUTORIALS) not in sys.path:
        sys.path.insert(0, str(TUTORIALS))
    import pagedkv_tutorial_helpers

    return pagedkv_tutorial_helpers
