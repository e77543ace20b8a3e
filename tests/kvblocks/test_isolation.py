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
