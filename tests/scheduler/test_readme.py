"""The README's usage example runs and prints what the README says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "packages/scheduler/README.md"


def test_readme_example_prints_what_it_says():
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    expected = re.search(r"\nprints\n\n```\n(.*?)```", text, re.S).group(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, str(README), "exec"), {})
    assert buf.getvalue() == expected
