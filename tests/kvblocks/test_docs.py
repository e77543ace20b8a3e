"""The README example runs as written, and the changelog covers this version."""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "packages" / "kvblocks"


def test_readme_quick_usage_runs() -> None:
    text = (PKG / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README must keep its runnable example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


def test_changelog_mentions_this_version() -> None:
    import kvblocks

    assert f"## {kvblocks.__version__}" in (PKG / "CHANGELOG.md").read_text()
