"""Where a benchmark or simulation ran: versions, machine, commit and command, recorded with its
figures.

Why one helper: a figure is only worth committing if it can be reproduced, so every benchmark
records the same facts the same way (this used to exist five times, each recording a different
subset). :func:`environment` is what the benchmarks put in their JSON line; the smaller functions
are there for a benchmark that prints one of them in its header.

torch is reported only when the benchmark has already imported it: the torch-free benchmarks
(the simulator, the scheduler and kvblocks micro-benchmarks) stay torch-free and quick to start.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["command_line", "environment", "git_commit", "hardware", "package_versions", "settings"]

#: The pagedkv distributions, and the module whose folder holds each one's ``__about__.py``.
DISTRIBUTIONS = {
    "kvblocks": "kvblocks",
    "pagedattn-kernels": "pagedattn_kernels",
    "pagedkv-scheduler": "pagedkv.scheduler",
    "pagedkv-engine": "pagedkv.engine",
    "pagedkv-server": "pagedkv.server",
    "pagedkv-bench": "pagedkv.bench",
}

_VERSION = re.compile(r"""__version__\s*=\s*['"]([^'"]+)['"]""")


def git_commit() -> str:
    """The checkout's short commit hash, with ``-dirty`` when tracked files have local changes,
    or ``unknown`` outside a git checkout.

    ``$PAGEDKV_COMMIT`` wins: a copied working tree (the GPU machine's) can carry a stale .git.
    """
    if os.environ.get("PAGEDKV_COMMIT"):
        return os.environ["PAGEDKV_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True, cwd=here, timeout=5,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True, cwd=here, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev + ("-dirty" if dirty else "")) if rev else "unknown"


def command_line(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    """The command that ran, as one would type it again.

    With ``argv`` (a ``main(argv)`` called from code), ``prog`` and those arguments. Otherwise
    this process's own command line: ``python -m module ...`` for a module run with ``-m``, else
    the script's name and its arguments (``pagedkv bench throughput ...``).
    """
    if argv is not None:
        return shlex.join([*shlex.split(prog or "python"), *argv])
    orig = list(getattr(sys, "orig_argv", []))
    if "-m" in orig[1:]:
        i = orig.index("-m", 1)
        return shlex.join(["python", *orig[i:]])
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return shlex.join([name, *sys.argv[1:]])


def _about_version(module: str) -> str | None:
    """The version in a package's ``__about__.py``, read without importing the package (some
    import torch): for a checkout put on ``PYTHONPATH`` rather than installed."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        about = Path(folder) / "__about__.py"
        if about.is_file():
            m = _VERSION.search(about.read_text(encoding="utf-8"))
            if m:
                return m.group(1)
    return None


def package_versions() -> dict[str, str]:
    """Version of each pagedkv distribution that is present (installed, or on the path)."""
    out: dict[str, str] = {}
    for dist, module in DISTRIBUTIONS.items():
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = _about_version(module)
            if version is not None:
                out[dist] = version
    return out


#: Environment variables that change what a run measures (kernel launch, fp8 paths, backend).
SETTING_PREFIXES = ("PAGEDATTN_", "PAGEDKV_FP8_", "PAGEDKV_FUSED_", "PAGEDKV_MATMUL_16BIT_")


def settings() -> dict[str, str]:
    """The ``PAGEDATTN_*``, ``PAGEDKV_FP8_*``, ``PAGEDKV_FUSED_*`` and ``PAGEDKV_MATMUL_16BIT_*``
    variables set for this run (e.g. ``PAGEDATTN_PDL=0``): the command line alone would not
    tell two such runs apart."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTING_PREFIXES)}


def hardware(device: Any = None) -> str:
    """One line about the device a benchmark measures: the GPU's name, SMs and memory for a
    CUDA device (``device`` or, by default, the current one when torch sees a GPU), else the
    CPU."""
    torch = sys.modules.get("torch")
    on_cuda = torch is not None and torch.cuda.is_available()
    if device is not None:
        on_cuda = on_cuda and str(getattr(device, "type", device)).startswith("cuda")
    if on_cuda:
        p = torch.cuda.get_device_properties(device if device is not None else 0)
        return f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def environment(
    *, argv: Sequence[str] | None = None, prog: str | None = None
) -> dict[str, Any]:
    """Python, platform, pagedkv package versions, git commit and command line; with torch
    (when already imported): torch, CUDA, triton and transformers versions and the GPU's name.

    ``argv``/``prog``: see :func:`command_line`.
    """
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "commit": git_commit(),
        "command": command_line(argv, prog),
        "packages": package_versions(),
    }
    if switches := settings():
        info["settings"] = switches
    torch = sys.modules.get("torch")
    if torch is None:
        return info
    info["torch"] = torch.__version__
    if torch.version.cuda:
        info["cuda"] = torch.version.cuda
    for name in ("triton", "transformers"):
        version = _dist_version(name)
        if version is not None:
            info[name] = version
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _dist_version(name: str) -> str | None:
    """An installed distribution's version, without importing it (transformers takes seconds)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(name), "__version__", None)
