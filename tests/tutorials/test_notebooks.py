"""Every tutorial notebook runs headless from a clean state, and is committed without outputs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest

TUTORIALS = Path(__file__).resolve().parents[2] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))

EXPECTED = [
    "01_paging.ipynb",
    "02_copy_on_write.ipynb",
    "03_swapping.ipynb",
    "04_prefix_sharing.ipynb",
    "05_scheduler.ipynb",
    "06_serving.ipynb",
]
# The CPU budget of each notebook in CI (2 cores); they take well under it.
TIMEOUT_PER_CELL_S = 300


def execute(path, jupyter_env: dict[str, str]) -> tuple[nbformat.NotebookNode, float]:
    """Run a fresh copy of the notebook in a new kernel, cwd = tutorials/; raise on any error."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name=jupyter_env["KERNEL_NAME"],
        timeout=TIMEOUT_PER_CELL_S,
        allow_errors=False,
        resources={"metadata": {"path": str(TUTORIALS)}},
    )
    t0 = time.perf_counter()
    try:
        client.execute()
    finally:
        keep = os.environ.get("PAGEDKV_NOTEBOOK_OUT")  # keep the executed copy, for a look
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, Path(keep) / path.name)
    return nb, time.perf_counter() - t0


def device_line(nb: nbformat.NotebookNode) -> str:
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "")
            if "running on" in text:
                return text.strip()
    return ""


def test_every_tutorial_is_there():
    assert [p.name for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], (
                f"{path.name} cell {i} has outputs: clear them before committing"
            )
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.metadata, (
        f"{path.name} stores widget state: clear it before committing"
    )
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), (
        f"{path.name} must open with a markdown title (the docs page title)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, jupyter_env):
    nb, seconds = execute(path, jupyter_env)
    line = device_line(nb)
    print(f"{path.name}: {seconds:.1f} s, {line}")
    assert line.startswith("running on cpu") or line.startswith("running on cuda"), (
        f"{path.name} must print the device it runs on"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_on_gpu(path, jupyter_env):
    nb, seconds = execute(path, jupyter_env)
    line = device_line(nb)
    print(f"{path.name}: {seconds:.1f} s on the GPU, {line}")
    assert line.startswith("running on cuda"), f"{path.name} did not pick the GPU: {line!r}"
