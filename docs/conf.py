"""Sphinx configuration of the pagedkv documentation site.

Build it with ``sphinx-build -W --keep-going -n docs docs/_build/html`` (the test suite does,
in ``tests/docs/test_sphinx_build.py``). Nothing is executed or downloaded at build time: the
API reference comes from the installed packages' docstrings, the CLI reference from
``pagedkv.engine.cli.build_parser()``, the tutorials are rendered from the committed notebooks
without running them, and the performance page reads ``docs/performance/*.json``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "pagedkv"
author = "pagedkv developers"
copyright = "pagedkv developers"

extensions = [
    "myst_nb",  # MyST markdown pages and the tutorial notebooks (includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
    "pagedkv_docs",  # our own: API-reference bookkeeping, tutorials copy, performance page
]

# Documented distributions, in dependency order: (import name, docs page slug, distribution).
pagedkv_packages = [
    ("kvblocks", "kvblocks", "kvblocks"),
    ("pagedattn_kernels", "pagedattn-kernels", "pagedattn-kernels"),
    ("pagedkv.scheduler", "scheduler", "pagedkv-scheduler"),
    ("pagedkv.engine", "engine", "pagedkv-engine"),
    ("pagedkv.server", "server", "pagedkv-server"),
    ("pagedkv.bench", "bench", "pagedkv-bench"),
]

# .rst first: autosummary writes its generated API pages with the first suffix.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "dev", "performance/_generated/*.json", "**/.ipynb_checkpoints"]
templates_path = ["_templates"]

# --- MyST and notebooks ---------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
myst_ref_domains = ["std", "py"]  # where [text](target) links may resolve
nb_execution_mode = "off"  # the test suite executes the notebooks; the docs only render them
nb_merge_streams = True

# --- API reference ----------------------------------------------------------------------------
autosummary_generate = True
autosummary_imported_members = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = True
napoleon_use_rtype = False

# Nitpicky about our own names: a reference to kvblocks / pagedattn_kernels / pagedkv that does
# not resolve is an error. Third-party and standard-library targets cannot resolve without
# fetching other projects' inventories (the build is offline), so they are not checked.
# Private names (a ``_Base`` class shown as a base) and type variables are not documented on
# purpose, so references to them are not checked either.
nitpick_ignore_regex = [
    (r"py:.*", r"(?!(kvblocks|pagedattn_kernels|pagedkv)(\.|$)).*"),
    (r"py:.*", r"(kvblocks|pagedattn_kernels|pagedkv)\..*\._\w*"),
    (r"py:.*", r"(kvblocks|pagedattn_kernels|pagedkv)\..*\.[A-Z][A-Z]?(_co|_contra)?"),
]

# --- HTML ----------------------------------------------------------------------------------------
# Literal blocks without a language (argparse usage, docstring examples) stay plain text.
highlight_language = "none"
html_theme = "furo"
html_title = "pagedkv"
html_static_path = ["_static"]
html_last_updated_fmt = None

suppress_warnings = [
    # myst-nb renders notebooks committed without outputs; it says so for each one otherwise.
    "mystnb.unknown_mime_type",
]


def _copy_tutorials() -> None:
    """Copy the committed notebooks into the source tree (docs/tutorials/) for rendering."""
    src = ROOT / "tutorials"
    dst = DOCS / "tutorials"
    notebooks = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    for nb in notebooks:
        target = dst / nb.name
        if not target.exists() or target.read_bytes() != nb.read_bytes():
            shutil.copyfile(nb, target)
    for stale in dst.glob("*.ipynb"):
        if stale.name not in {nb.name for nb in notebooks}:
            stale.unlink()


_copy_tutorials()
