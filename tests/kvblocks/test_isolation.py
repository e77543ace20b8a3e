"""kvblocks is stdlib only: importing it (all of its modules) in a fresh interpreter pulls in no
torch and no third-party module at all."""

from __future__ import annotations

import json
import subprocess
import sys

CODE = """
import json, pkgutil, sys, importlib
import kvblocks
for info in pkgutil.iter_modules(kvblocks.__path__):
    importlib.import_module("kvblocks." + info.name)
print(json.dumps(sorted(sys.modules)))
"""


def test_import_kvblocks_leaves_torch_out() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    modules = json.loads(out.strip().splitlines()[-1])
    assert "kvblocks.manager" in modules
    assert "torch" not in modules
    third_party = {
        m.split(".")[0]
        for m in modules
        if m.split(".")[0] not in sys.stdlib_module_names and not m.startswith("kvblocks")
    }
    # Interpreter start-up hooks of a virtual environment may appear; nothing else may.
    assert third_party <= {"__main__", "_distutils_hack", "_virtualenv", "sitecustomize"}, (
        third_party
    )


def test_kvblocks_modules_import_each_other_without_a_cycle() -> None:
    """Every import between kvblocks' modules (including ``if TYPE_CHECKING:`` ones) goes one
    way: the dependency graph is acyclic, so no module needs a deferred import to load."""
    import ast
    from pathlib import Path

    import kvblocks

    pkg = Path(kvblocks.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in pkg.glob("*.py"):
        if path.stem == "__init__":
            continue
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvblocks."):
                deps.add(node.module.split(".")[1])
        graph[path.stem] = deps
    assert graph["prefix_cache"] >= {"table", "cache_entry"}  # what used to be a cycle
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, f"import cycle: {' -> '.join((*path, mod))}"
        if mod in done:
            return
        for dep in graph.get(mod, ()):
            visit(dep, (*path, mod))
        done.add(mod)

    for mod in graph:
        visit(mod, ())
