#!/usr/bin/env python3
"""Execute the tutorial notebooks with their exercises solved, and check every exercise.

    python scripts/run_tutorials.py [NOTEBOOK ...] [--out DIR] [--record FILE] [--small]

Each notebook runs top to bottom in a fresh kernel of this interpreter (a kernel spec made in
a temporary folder: nothing is registered), with ``tutorials/`` as its working directory. At
each exercise (a code cell whose metadata has ``"exercise": "<id>"``) it runs the blank cell
and the exercise's check (``"check": "<id>"``), which must raise ``NotSolved``; then the
solution from ``tutorials/solutions/<notebook>.py`` and the check again, which must pass. Any
other error fails the notebook.

``--out DIR``: the executed notebooks as the docs show them (the solutions filled in and
marked, the blank runs left out, widget state stored). ``--record FILE``: a JSON record of the
run (device line and seconds per notebook, exercises, versions). ``--small`` sets
``PAGEDKV_TUTORIAL_SMALL=1`` (the notebooks' quick run, used by the test suite).

The test suite (``tests/tutorials/test_notebooks.py``), the docs build (``docs/conf.py``) and
the GPU run (``scripts/gpu_notebooks.sh``) all use this module.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
SOLUTIONS = TUTORIALS / "solutions"
KERNEL_NAME = "pagedkv-tutorials"
SMALL_ENV = "PAGEDKV_TUTORIAL_SMALL"
SOLUTION_HEADER = "# Solution (tutorials/solutions/{file}); the notebook leaves this cell to you.\n"
_MARK = re.compile(r"^# %% exercise (\S+)\s*$", re.M)


class TutorialError(Exception):
    """A notebook failed: a cell raised, or an exercise's check did not behave."""


DOCS_COPIES = ROOT / "docs" / "_executed_tutorials"


def source_stamp(notebook: Path) -> str:
    """sha256 of what an executed copy was made from: the notebook, its solutions and the
    helper package (the docs reuse a copy only while this matches)."""
    import hashlib

    h = hashlib.sha256()
    files = [notebook, solutions_path(notebook), *sorted((TUTORIALS / "pagedkv_tutorial_helpers").glob("*.py"))]
    for f in files:
        if f.exists():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def notebooks() -> list[Path]:
    return sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))


def solutions_path(notebook: Path) -> Path:
    return SOLUTIONS / f"{notebook.stem}.py"


def load_solutions(path: Path) -> dict[str, str]:
    """Exercise id -> solution source, from ``# %% exercise <id>`` sections of ``path``."""
    text = path.read_text()
    marks = list(_MARK.finditer(text))
    found: dict[str, str] = {}
    for m, nxt in zip(marks, [*marks[1:], None]):
        body = text[m.end() : nxt.start() if nxt else len(text)].strip("\n")
        if m.group(1) in found:
            raise TutorialError(f"{path.name}: exercise {m.group(1)} has two solutions")
        found[m.group(1)] = body
    return found


def exercise_ids(nb) -> tuple[list[str], list[str]]:
    """The ids of the exercise cells and of the check cells, in notebook order."""
    ex = [c.metadata["exercise"] for c in nb.cells if "exercise" in c.get("metadata", {})]
    ch = [c.metadata["check"] for c in nb.cells if "check" in c.get("metadata", {})]
    return ex, ch


@dataclass(slots=True)
class Step:
    """One cell to run: what must happen (``"ok"`` or ``"not-solved"``), and whether the
    docs copy keeps it."""

    cell: object
    expect: str
    keep: bool


def plan(nb, solutions: dict[str, str], *, check_blanks: bool = True, file: str = "") -> list[Step]:
    """The cells to run: each exercise blank then its check (must fail), then the solution and
    the check again (must pass). Raises TutorialError when cells and solutions do not match."""
    import copy

    import nbformat

    exercises, checks = exercise_ids(nb)
    if sorted(exercises) != sorted(checks) or len(set(exercises)) != len(exercises):
        raise TutorialError(f"{file}: exercises {exercises} and checks {checks} do not pair up")
    if set(exercises) != set(solutions):
        raise TutorialError(
            f"{file}: exercises {sorted(exercises)} but solutions for {sorted(solutions)}"
        )
    steps: list[Step] = []
    cells = list(nb.cells)
    for i, cell in enumerate(cells):
        meta = cell.get("metadata", {})
        if "check" in meta:
            continue  # run with its exercise, below
        if "exercise" not in meta:
            steps.append(Step(copy.deepcopy(cell), "ok", keep=True))
            continue
        ex = meta["exercise"]
        check = cells[i + 1] if i + 1 < len(cells) else None
        if check is None or check.get("metadata", {}).get("check") != ex:
            raise TutorialError(f"{file}: exercise {ex} must be followed by its check cell")
        if check_blanks:
            steps.append(Step(copy.deepcopy(cell), "ok", keep=False))
            steps.append(Step(copy.deepcopy(check), "not-solved", keep=False))
        solved = nbformat.v4.new_code_cell(
            SOLUTION_HEADER.format(file=file) + solutions[ex],
            metadata={**cell.metadata, "solution": True},
        )
        steps.append(Step(solved, "ok", keep=True))
        steps.append(Step(copy.deepcopy(check), "ok", keep=True))
    return steps


@contextmanager
def kernel_env() -> Iterator[str]:
    """Jupyter paths in a temporary folder with one kernel spec that runs this interpreter;
    yields the kernel name. The caller's environment is restored afterwards."""
    with tempfile.TemporaryDirectory(prefix="pagedkv-jupyter-") as base:
        spec = Path(base) / "data" / "kernels" / KERNEL_NAME
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "pagedkv tutorials (this interpreter)",
            "language": "python",
            "metadata": {"debugger": False},
        }))  # fmt: skip
        env = {
            "JUPYTER_PATH": f"{base}/data",
            "JUPYTER_CONFIG_DIR": f"{base}/config",
            "JUPYTER_RUNTIME_DIR": f"{base}/runtime",
            "JUPYTER_DATA_DIR": f"{base}/data",
            "JUPYTER_PLATFORM_DIRS": "1",
            "IPYTHONDIR": f"{base}/ipython",
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            "TQDM_DISABLE": "1",
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield KERNEL_NAME
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@dataclass(slots=True)
class Result:
    """One executed notebook."""

    name: str
    seconds: float
    device: str
    executed: object  # the notebook as the docs show it
    exercises: dict[str, dict[str, str]] = field(default_factory=dict)


def device_line(nb) -> str:
    """The notebook's ``running on ...`` line (its first code cell prints it)."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "")
            if "running on" in text:
                return next(t for t in text.splitlines() if "running on" in t).strip()
    return ""


def _plain(text: str, keep: int = 3000) -> str:
    """A traceback without its terminal colors, its end kept."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)[-keep:]


async def _run(client, steps: list[Step], name: str) -> dict[str, dict[str, str]]:
    from jupyter_core.utils import ensure_async
    from nbclient.exceptions import CellExecutionError

    exercises: dict[str, dict[str, str]] = {}
    async with client.async_setup_kernel():
        msg_id = await ensure_async(client.kc.kernel_info())
        info = await client.async_wait_for_reply(msg_id)
        if info is not None and "language_info" in info["content"]:
            client.nb.metadata["language_info"] = info["content"]["language_info"]
        for index, step in enumerate(steps):
            ex = step.cell.metadata.get("check")
            try:
                await client.async_execute_cell(
                    step.cell, index, execution_count=client.code_cells_executed + 1
                )
            except CellExecutionError as err:
                if step.expect == "not-solved" and err.ename == "NotSolved":
                    exercises.setdefault(ex, {})["blank"] = "check failed (NotSolved), as it must"
                    continue
                where = f"exercise {ex}'s check" if ex else f"cell {index}"
                raise TutorialError(
                    f"{name}: {where} raised {err.ename}: {err.evalue}\n--- cell ---\n"
                    f"{step.cell.source[:1500]}\n--- traceback ---\n{_plain(err.traceback)}"
                ) from None
            if step.expect == "not-solved":
                raise TutorialError(
                    f"{name}: exercise {ex}'s check passes on the blank exercise cell: it must "
                    "fail until the exercise is solved"
                )
            if ex is not None:
                exercises.setdefault(ex, {})["solution"] = "check passed"
        client.set_widgets_metadata()
    return exercises


def execute(path: Path, kernel_name: str, *, timeout: int = 600, check_blanks: bool = True,
            solutions: Path | None = None) -> Result:  # fmt: skip
    """Run one notebook (see the module docstring); raises TutorialError on any failure."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    sol = solutions or solutions_path(path)
    steps = plan(nb, load_solutions(sol) if sol.exists() else {}, check_blanks=check_blanks,
                 file=sol.name)  # fmt: skip
    run_nb = nbformat.v4.new_notebook(metadata=nb.metadata)
    run_nb.cells = [s.cell for s in steps]
    client = NotebookClient(
        run_nb, kernel_name=kernel_name, timeout=timeout, allow_errors=False,
        store_widget_state=True, resources={"metadata": {"path": str(TUTORIALS)}},
    )  # fmt: skip
    t0 = time.perf_counter()
    exercises = asyncio.run(_run(client, steps, path.name))
    seconds = time.perf_counter() - t0
    executed = nbformat.v4.new_notebook(metadata=run_nb.metadata)
    executed.cells = [s.cell for s in steps if s.keep]
    for i, cell in enumerate(executed.cells):
        cell.id = f"cell-{i}"
    executed.metadata["pagedkv"] = {
        "source_sha256": source_stamp(path), "device": device_line(executed),
        "seconds": round(seconds, 1), "small": os.environ.get(SMALL_ENV) == "1",
    }  # fmt: skip
    return Result(path.name, seconds, device_line(executed), executed, exercises)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {"python": platform.python_version()}
    for dist in ("torch", "triton", "transformers", "ipykernel", "nbclient", "ipywidgets", "openai"):
        with contextlib.suppress(md.PackageNotFoundError):
            found[dist] = md.version(dist)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", help="notebook files or names (default: all six)")
    p.add_argument("--out", type=Path, help="write the executed notebooks (docs copies) here")
    p.add_argument("--docs", action="store_true",
                   help=f"write them where the docs build takes them ({DOCS_COPIES.relative_to(ROOT)})")
    p.add_argument("--record", type=Path, help="write a JSON record of the run here")
    p.add_argument("--small", action="store_true", help=f"set {SMALL_ENV}=1 (quick run)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    p.add_argument("--no-blank-check", action="store_true",
                   help="only run the solutions (skip checking that each check fails on the blank)")
    args = p.parse_args(argv)
    paths = [Path(n) if n.endswith(".ipynb") else TUTORIALS / f"{n}.ipynb" for n in args.notebooks]
    paths = [p if p.is_absolute() or p.exists() else TUTORIALS / p.name for p in paths] or notebooks()
    if args.docs:
        args.out = DOCS_COPIES
    if args.small:
        os.environ[SMALL_ENV] = "1"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    record = {"commit": os.environ.get("PAGEDKV_COMMIT", ""), "small": args.small,
              "host": platform.node(), "versions": versions(), "notebooks": []}  # fmt: skip
    failed = 0
    with kernel_env() as kernel:
        for path in paths:
            entry: dict[str, object] = {"notebook": path.name}
            try:
                r = execute(path, kernel, timeout=args.timeout, check_blanks=not args.no_blank_check)
            except Exception as exc:  # report and go on with the next notebook
                failed += 1
                entry.update(ok=False, error=str(exc)[-4000:])
                print(f"FAILED {path.name}: {str(exc)[-2000:]}", flush=True)
            else:
                entry.update(ok=True, seconds=round(r.seconds, 1), device=r.device,
                             exercises=r.exercises)  # fmt: skip
                print(f"{r.name}: {r.seconds:.1f} s, {r.device}, {len(r.exercises)} exercises "
                      "checked", flush=True)  # fmt: skip
                if args.out:
                    import nbformat

                    nbformat.write(r.executed, args.out / path.name)
            record["notebooks"].append(entry)
            if args.record:
                args.record.parent.mkdir(parents=True, exist_ok=True)
                args.record.write_text(json.dumps(record, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
