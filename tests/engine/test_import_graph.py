"""No import circles in ``pagedkv.engine``: not at import time, and not behind lazy imports.

Two checks:

* a static graph of the engine's modules built with ``ast``: an edge for every ``import`` in a
  module, at its top level or inside a function (a lazy import only postpones a circle), except
  under ``if TYPE_CHECKING:``; importing ``a.b.c`` also runs packages ``a`` and ``a.b``, so
  those are edges too (except a module's own packages, which ran before it). The model registry imports its model modules by name
  (``importlib``): each name in its table is an edge as well. The graph must be acyclic.
  (``pagedkv.engine.__getattr__`` resolves the package's public names for users on first
  access; engine code never goes through it, so those are not edges.)
* a fresh interpreter imports every engine module in a random order, then each module again
  as the first engine module imported (the situation in which a circle breaks an import).
"""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import pagedkv.engine
from pagedkv.engine.models.registry import MODEL_SPECS

ENGINE_DIR = Path(pagedkv.engine.__file__).parent
REGISTRY = "pagedkv.engine.models.registry"


def module_names(package_dir: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir``."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(source: str, module: str, is_package: bool, *, lazy: bool) -> set[str]:
    """Every dotted name a module's import statements may load (``from a import b`` may load
    module ``a.b``); with ``lazy=False`` only those at module level (class bodies included)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                if lazy:
                    visit(child)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")
                    base = base[: len(base) - child.level + (1 if is_package else 0)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(source))
    return found


def import_graph(
    modules: Mapping[str, Path], *, lazy: bool, dynamic: Mapping[str, Iterable[str]] = {}
) -> dict[str, set[str]]:
    """module -> the modules (of ``modules``) importing it runs, directly."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for dotted in imported_names(
            path.read_text(), name, path.name == "__init__.py", lazy=lazy
        ):
            parts = dotted.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first ...
                prefix = ".".join(parts[:i])
                if prefix in modules and not (name == prefix or name.startswith(prefix + ".")):
                    targets.add(prefix)  # ... but this module's own packages already ran
        if lazy:
            targets.update(dynamic.get(name, ()))
        graph[name] = targets
    return graph


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None if it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := dfs(start)):
            return cycle
    return None


def _engine_graph(*, lazy: bool) -> dict[str, set[str]]:
    modules = module_names(ENGINE_DIR, "pagedkv.engine")
    dynamic = {REGISTRY: {spec.module for spec in MODEL_SPECS.values()}}
    assert dynamic[REGISTRY] <= set(modules), "the registry names a module that does not exist"
    return import_graph(modules, lazy=lazy, dynamic=dynamic)


# --------------------------------------------------------------------------- the checker itself


def test_the_checker_finds_a_circle_held_off_by_a_lazy_import(tmp_path):
    """The shape of the circle the registry removed: a package imported at the top of a module,
    the package importing a model lazily, the model importing that module back."""
    pkg = tmp_path / "pkg"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from pkg.models import get_class\n")
    (pkg / "models" / "__init__.py").write_text(
        "def get_class():\n    from pkg.models.llama import Llama\n    return Llama\n"
    )
    (pkg / "models" / "llama.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .layers import x\n"
        "if TYPE_CHECKING:\n    from pkg.models import get_class\n"
    )
    (pkg / "models" / "layers.py").write_text("def f():\n    from ..config import y\n")
    modules = module_names(pkg, "pkg")
    assert find_cycle(import_graph(modules, lazy=False)) is None
    cycle = find_cycle(import_graph(modules, lazy=True))
    assert cycle is not None
    assert set(cycle) == {"pkg.config", "pkg.models", "pkg.models.llama", "pkg.models.layers"}
    # a dynamic (importlib) edge closes a circle as well
    (pkg / "models" / "layers.py").write_text("")
    assert find_cycle(import_graph(modules, lazy=True)) is None
    dynamic = {"pkg.models.llama": {"pkg.config"}}
    assert find_cycle(import_graph(modules, lazy=True, dynamic=dynamic)) is not None


# --------------------------------------------------------------------------- the engine


def test_engine_modules_import_each_other_without_circles():
    graph = _engine_graph(lazy=False)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    assert "pagedkv.engine.distributed.parallel_state" in graph[
        "pagedkv.engine.distributed.executor"
    ]  # the graph sees the engine's real imports


def test_engine_has_no_circle_behind_lazy_or_registry_imports():
    graph = _engine_graph(lazy=True)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_model_code_reaches_neither_config_nor_registry_nor_process_groups():
    """What keeps the graph acyclic, said directly: everything a model module imports, however
    indirectly, stays below the registry."""
    graph = _engine_graph(lazy=True)
    forbidden = {
        REGISTRY,
        "pagedkv.engine.config",
        "pagedkv.engine.distributed.parallel_state",
        "pagedkv.engine.model_loader",
    }
    for spec in MODEL_SPECS.values():
        seen, todo = set(), [spec.module]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert not seen & forbidden, (spec.module, sorted(seen & forbidden))


_IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, sys
    names = json.loads(sys.argv[1])
    failures = {}
    for name in names:  # one interpreter, random order
        try:
            importlib.import_module(name)
        except Exception as exc:
            failures["in order: " + name] = repr(exc)
    for name in names:  # each as the first engine module (torch and the kernels stay loaded)
        for loaded in [m for m in sys.modules if m == "pagedkv.engine" or
                       m.startswith("pagedkv.engine.")]:
            del sys.modules[loaded]
        try:
            importlib.import_module(name)
        except Exception as exc:
            failures["first: " + name] = repr(exc)
    print(json.dumps(failures))
    """
)


@pytest.mark.slow
def test_every_engine_module_imports_first_in_a_fresh_interpreter():
    names = sorted(module_names(ENGINE_DIR, "pagedkv.engine"))
    random.Random(15).shuffle(names)
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert failures == {}
