"""Make the scheduler test harness (sched_harness.py) importable from the tests beside it."""

from __future__ import annotations

import sys
from pathlib import Path

_here = str(Path(__file__).resolve().parent)
if _here not in sys.path:
    sys.path.insert(0, _here)
