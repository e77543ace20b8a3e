"""The tutorial notebooks: committed clean, with exercises that pair up with checks and
solutions; each runs headless from a clean state with its solutions filled in, and each
exercise's check fails on the blank cell (scripts/run_tutorials.py does both in one kernel)."""

from __future__ import annotations

import os
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
# Seconds per cell: a notebook takes well under it on the CI machine (2 cores).
TIMEOUT_PER_CELL_S = 600
ids = [p.stem for p in NOTEBOOKS]


def test_every_tutorial_is_there():
    assert [p.name for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_exercises_pair_with_checks_and_solutions(path, runner):
    nb = nbformat.read(path, as_version=4)
    exercises, checks = runner.exercise_ids(nb)
    assert len(exercises) >= 2, f"{path.name}: at least two 'your turn' exercises"
    assert exercises == checks
    solutions = runner.load_solutions(runner.solutions_path(path))
    assert set(solutions) == set(exercises), f"{path.name}: a solution per exercise, no other"
    for ex in exercises:
        blank = next(c for c in nb.cells if c.metadata.get("exercise") == ex)
        check = next(c for c in nb.cells if c.metadata.get("check") == ex)
        assert f'helpers.checking("{ex}")' in check.source, f"{path.name}: check {ex} must use checking()"
        assert blank.source.strip() != solutions[ex].strip(), f"{path.name}: {ex} holds its solution"
        assert "your" in blank.source, f"{path.name}: exercise {ex} must say where the learner's code goes"
    steps = runner.plan(nb, solutions, file=path.name)
    expected = [s.expect for s in steps]
    assert expected.count("not-solved") == len(exercises)


def test_plan_refuses_mismatched_exercises(runner):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("x = None", metadata={"exercise": "9.1"}),
        nbformat.v4.new_code_cell("print(1)"),
        nbformat.v4.new_code_cell("assert x", metadata={"check": "9.1"}),
    ]
    with pytest.raises(runner.TutorialError, match="followed by its check"):
        runner.plan(nb, {"9.1": "x = 1"})
    nb.cells = [nb.cells[0], nb.cells[2]]
    with pytest.raises(runner.TutorialError, match="solutions"):
        runner.plan(nb, {})
    steps = runner.plan(nb, {"9.1": "x = 1"})
    assert [(s.expect, s.keep) for s in steps] == [
        ("ok", False), ("not-solved", False), ("ok", True), ("ok", True)
    ]
    assert steps[2].cell.source.endswith("x = 1") and steps[2].cell.metadata["solution"]


def test_load_solutions_reads_sections(runner, tmp_path):
    f = tmp_path / "s.py"
    f.write_text('"""doc"""\n\n# %% exercise 1.1\ndef f():\n    return 1\n\n\n# %% exercise 1.2\ny = 2\n')
    assert runner.load_solutions(f) == {"1.1": "def f():\n    return 1", "1.2": "y = 2"}
    f.write_text("# %% exercise 1.1\na = 1\n# %% exercise 1.1\na = 2\n")
    with pytest.raises(runner.TutorialError, match="two solutions"):
        runner.load_solutions(f)


def check_executed(result, runner, path) -> None:
    nb = result.executed
    assert result.device.startswith(("running on cpu", "running on cuda")), result.device
    exercises, _ = runner.exercise_ids(nbformat.read(path, as_version=4))
    assert set(result.exercises) == set(exercises)
    for ex, outcome in result.exercises.items():
        assert outcome == {"blank": "check failed (NotSolved), as it must", "solution": "check passed"}, ex
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            assert out["output_type"] != "error", f"{path.name} cell {i}: {out.get('evalue')}"
        if cell.metadata.get("solution"):
            assert cell.source.startswith("# Solution (tutorials/solutions/")
    solved = [c for c in nb.cells if "check" in c.metadata]
    assert all("✓ exercise" in "".join(o.get("text", "") for o in c.outputs) for c in solved)
    views = [o for c in nb.cells for o in c.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]  # fmt: skip
    if views:  # the docs render widgets from this stored state
        state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
        for v in views:
            assert v["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] in state


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_runs_and_checks_its_exercises(path, runner, kernel_name):
    result = runner.execute(path, kernel_name, timeout=TIMEOUT_PER_CELL_S)
    print(f"{path.name}: {result.seconds:.1f} s, {result.device}")
    check_executed(result, runner, path)
    keep = os.environ.get("PAGEDKV_NOTEBOOK_OUT")  # keep the executed copy, for a look
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        nbformat.write(result.executed, Path(keep) / path.name)


@pytest.mark.gpu
@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_runs_on_gpu(path, runner, kernel_name):
    result = runner.execute(path, kernel_name, timeout=TIMEOUT_PER_CELL_S)
    print(f"{path.name}: {result.seconds:.1f} s on the GPU, {result.device}")
    assert result.device.startswith("running on cuda"), f"{path.name} did not pick the GPU"
    check_executed(result, runner, path)
