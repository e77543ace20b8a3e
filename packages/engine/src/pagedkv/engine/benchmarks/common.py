"""What every benchmark prints about its setup, so a figure can be reproduced."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def git_commit() -> str:
    """The checkout's commit; `PAGEDKV_COMMIT` wins (a copied working tree, such as the GPU
    machine's, can carry a stale .git)."""
    if os.environ.get("PAGEDKV_COMMIT"):
        return os.environ["PAGEDKV_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True, cwd=Path(__file__).parent, timeout=5,
        )
        return out.stdout.strip()
    except Exception:
        return "unknown"


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": __import__("os").cpu_count(),
        "commit": git_commit(),
        "command": " ".join(["pagedkv", *sys.argv[1:]]) if sys.argv else "",
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


@contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """The names of the Triton kernel variants compiled inside the block, in order. A compile
    inside a timed run is a pass stalled for about a second: a benchmark reports these. Stays
    empty without triton, or with a triton that has no compile hook (before 3.4)."""
    names: list[str] = []
    try:
        from triton import knobs

        runtime = knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield names
        return

    def hook(*args: Any, **kwargs: Any) -> Any:
        names.append(getattr(kwargs.get("fn"), "name", "?"))
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        runtime.jit_post_compile_hook = previous


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}"
        return str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


def print_json_line(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, sort_keys=True))
