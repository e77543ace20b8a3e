"""The documentation site builds with warnings as errors, nitpicky, and has every page."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")

PAGES = [
    "index.html",
    "getting-started.html",
    "installing.html",
    "architecture.html",
    "cli.html",
    "tensor-parallel.html",
    "paper-reproduction.html",
    "packages/kvblocks.html",
    "packages/pagedattn-kernels.html",
    "packages/scheduler.html",
    "packages/engine.html",
    "packages/server.html",
    "packages/bench.html",
    "api/kvblocks.html",
    "api/pagedattn_kernels.html",
    "api/pagedkv.scheduler.html",
    "api/pagedkv.engine.html",
    "api/pagedkv.server.html",
    "api/pagedkv.bench.html",
    "tutorials/index.html",
    *(f"tutorials/{nb.stem}.html" for nb in sorted((ROOT / "tutorials").glob("*.ipynb"))),
    "performance/index.html",
    "changelog/index.html",
    *(
        f"changelog/{p}.html"
        for p in ("kvblocks", "pagedattn-kernels", "scheduler", "engine", "server", "bench")
    ),
]


def text_of(page: str) -> str:
    """The visible text of an HTML page (tags removed, entities decoded, spaces collapsed)."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())


def sphinx_build(src: Path, out: Path, doctrees: Path) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-n",
        "-q",
        "-d",
        str(doctrees),
        str(src),
        str(out),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("docs")
    out = base / "html"
    proc = sphinx_build(DOCS, out, base / "doctrees")
    assert proc.returncode == 0, (
        "sphinx-build -W --keep-going -n docs failed:\n" + proc.stdout[-4000:] + proc.stderr[-8000:]
    )
    return out


@pytest.mark.slow
def test_every_page_is_built(site: Path):
    missing = [p for p in PAGES if not (site / p).is_file()]
    assert not missing, f"pages missing from the built site: {missing}"


@pytest.mark.slow
def test_api_reference_comes_from_the_docstrings(site: Path):
    import kvblocks

    page = (site / "api" / "kvblocks.html").read_text(encoding="utf-8")
    # the package page documents the public names under the name users import
    for name in ("BlockManager", "BlockPool", "KVStats", "NoFreeBlocksError"):
        assert f'id="kvblocks.{name}"' in page, f"kvblocks.{name} is not documented"
    doc = kvblocks.BlockManager.allocate_slots.__doc__.strip().split("\n")[0]
    assert doc.split()[0] in page


@pytest.mark.slow
def test_cli_reference_comes_from_the_parser(site: Path):
    from pagedkv.engine.cli import build_parser

    page = text_of((site / "cli.html").read_text(encoding="utf-8"))
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in commands:
        assert name in page, f"subcommand {name} is missing from the CLI reference"
    for flag in ("--block-size", "--gpu-memory-utilization", "--enable-prefix-caching"):
        assert flag in page


@pytest.mark.slow
def test_changelogs_are_the_packages_own(site: Path):
    for folder, page in (("kvblocks", "kvblocks"), ("engine", "engine"), ("server", "server")):
        first = (
            (ROOT / "packages" / folder / "CHANGELOG.md").read_text().splitlines()[0].lstrip("# ")
        )
        assert first in (site / "changelog" / f"{page}.html").read_text(encoding="utf-8")


@pytest.mark.slow
def test_performance_extension_renders_results(tmp_path: Path):
    """The performance directive on a small project: tables, a plot and the command of each file."""
    src = tmp_path / "src"
    (src / "performance").mkdir(parents=True)
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(DOCS / '_ext')!r})\n"
        "extensions = ['myst_parser', 'pagedkv_docs']\nnitpicky = True\n"
    )
    (src / "index.md").write_text("# Results\n\n```{pagedkv-performance}\n```\n")
    sim = {
        "benchmark": "scheduler simulator",
        "command": "python -m pagedkv.bench.sim --rate 2",
        "hardware": "2-core CPU",
        "versions": {"pagedkv-scheduler": "0.1.0"},
        "commit": "abc1234",
        "paged": {"avg_batched_requests": 30.5, "kv_utilization": 0.96},
        "max": {"avg_batched_requests": 7.25, "kv_utilization": 0.21},
        "sweep": [
            {"policy": "paged", "request_rate": 1.0, "normalized_latency": 0.5},
            {"policy": "paged", "request_rate": 2.0, "normalized_latency": 0.7},
            {"policy": "max", "request_rate": 1.0, "normalized_latency": 1.5},
            {"policy": "max", "request_rate": 2.0, "normalized_latency": 9.0},
        ],
    }
    (src / "performance" / "sim.json").write_text(json.dumps(sim))
    (src / "performance" / "kernels.json").write_text(
        json.dumps(
            {
                "command": "python -m pagedkv.bench.kernels",
                "copy_bw_TBps": 4.1234,
                "decode_bw_frac_b64_c4k": 0.87,
            }
        )
    )
    out = tmp_path / "html"
    proc = sphinx_build(src, out, tmp_path / "doctrees")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    raw = (out / "index.html").read_text(encoding="utf-8")
    page = text_of(raw)
    assert "python -m pagedkv.bench.sim --rate 2" in page
    assert "python -m pagedkv.bench.kernels" in page
    assert "30.5" in page and "0.96" in page and "7.25" in page  # the per-policy table
    assert "4.123" in page and "0.87" in page  # the scalar figures
    assert "abc1234" in page
    plots = sorted(p.name for p in (out / "_images").glob("*.png"))
    assert any("sweep" in p for p in plots), plots  # normalized latency against request rate
    assert raw.count("<table") >= 4


def test_markdown_habits_in_docstrings_become_rest():
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        from pagedkv_docs import markdownish_to_rst
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    doc = [
        "`Engine`: one step, see :class:`Foo` and `docs <https://x>`_.",
        "```python",
        "x = step()  # `not touched`",
        "```",
        "Measured:",
        "- one",
        "  continued",
        "- two",
        "After the list.",
        "",
        "Example::",
        "",
        "    - kept `as is`",
        "Done with ``literal``.",
    ]
    assert markdownish_to_rst(doc) == [
        "``Engine``: one step, see :class:`Foo` and `docs <https://x>`_.",
        "",
        ".. code-block:: python",
        "",
        "   x = step()  # `not touched`",
        "",
        "Measured:",
        "",
        "- one",
        "  continued",
        "- two",
        "",
        "After the list.",
        "",
        "Example::",
        "",
        "    - kept `as is`",
        "Done with ``literal``.",
    ]
    valid = ["A :func:`f` and ``g``.", "", "- a", "- b", "", "Text::", "", "    code"]
    assert markdownish_to_rst(valid) == valid
