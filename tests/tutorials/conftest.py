"""Fixtures of the tutorial tests: a Jupyter kernel bound to this interpreter, the helper module."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "tutorials"
KERNEL_NAME = "pagedkv-tutorials"


@pytest.fixture(scope="session")
def jupyter_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Jupyter paths in a temporary folder, with one kernel spec that runs this interpreter.

    Nothing is registered globally: the kernel spec lives in the temporary folder, found first
    through JUPYTER_PATH, and it names ``sys.executable`` so the notebooks run in this virtual
    environment whatever other kernels the machine has.
    """
    base = tmp_path_factory.mktemp("jupyter")
    spec = base / "data" / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "pagedkv tutorials (this venv)",
                "language": "python",
                "metadata": {"debugger": False},
            }
        )
    )
    env = {
        "JUPYTER_PATH": str(base / "data"),
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTER_DATA_DIR": str(base / "data"),
        "JUPYTER_PLATFORM_DIRS": "1",
        "IPYTHONDIR": str(base / "ipython"),
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "TQDM_DISABLE": "1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield {**env, "KERNEL_NAME": KERNEL_NAME}


@pytest.fixture(scope="session")
def helpers():
    """The tutorials' helper module, imported from its file like the notebooks do."""
    spec = importlib.util.spec_from_file_location(
        "pagedkv_tutorial_helpers", TUTORIALS / "pagedkv_tutorial_helpers.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
