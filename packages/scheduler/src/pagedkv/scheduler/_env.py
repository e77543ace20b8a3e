"""Where a benchmark or simulation ran: versions, machine and commit, recorded with its figures."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

from pagedkv.scheduler.__about__ import __version__


def commit() -> str:
    """The checkout's short commit hash (with ``-dirty`` for local changes), or ``unknown``."""
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=here,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            check=True,
            cwd=here,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("-dirty" if dirty else "")


def environment() -> dict[str, str]:
    try:
        from kvblocks import __version__ as kv_version
    except ImportError:  # pragma: no cover - kvblocks is a dependency
        kv_version = "unknown"
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "platform": platform.platform(terse=True),
        "scheduler_version": __version__,
        "kvblocks_version": kv_version,
        "commit": commit(),
    }
