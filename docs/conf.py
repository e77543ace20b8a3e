"""Sphinx configuration of the pagedkv documentation site.

Build it with ``sphinx-build -W --keep-going -n docs docs/_build/html`` (the test suite does,
in ``tests/docs/test_sphinx_build.py``). Nothing is executed or downloaded at build time: the
API reference comes from the installed packages' docstrings, the CLI reference from
``pagedkv.engine.cli.build_parser()``, and the performance page reads
``docs/performance/*.json``. The tutorials are shown executed, with their outputs and widget
state, from the copies ``python scripts/run_tutorials.py --docs`` makes (in
``docs/_executed_tutorials/``, each stamped with the sha256 of the notebook, its solutions and
the helper package); with ``PAGEDKV_DOCS_EXECUTE=1`` the build makes the missing or stale ones
itself. A notebook without a current executed copy is shown as committed, without outputs, and
its page says so.
"""

from __future__ import annotations

import os
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
exclude_patterns = [
    "_build",
    "dev",
    "performance/_generated/*.json",
    "**/.ipynb_checkpoints",
    "_executed_tutorials",
]
templates_path = ["_templates"]

# --- MyST and notebooks ---------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
myst_ref_domains = ["std", "py"]  # where [text](target) links may resolve
nb_execution_mode = "off"  # executed copies come from scripts/run_tutorials.py (see above)
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


def _runner():
    """scripts/run_tutorials.py, imported by path (it is a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_tutorials", ROOT / "scripts" / "run_tutorials.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


NOT_EXECUTED = (
    "```{note}\nThis page shows the notebook as committed, without outputs: no current executed "
    "copy was found when the docs were built. Run `python scripts/run_tutorials.py --docs` "
    "before `sphinx-build` (or build with `PAGEDKV_DOCS_EXECUTE=1`) to see it executed.\n```"
)


def _copy_tutorials() -> None:
    """Put each tutorial into the source tree (docs/tutorials/): its executed copy when one
    matches the current sources, else the committed notebook with a note saying so."""
    import nbformat

    runner = _runner()
    src = ROOT / "tutorials"
    dst = DOCS / "tutorials"
    notebooks = sorted(src.glob("[0-9][0-9]_*.ipynb"))
    stale = []
    for nb_path in notebooks:
        executed = runner.DOCS_COPIES / nb_path.name
        stamp = runner.source_stamp(nb_path)
        ok = executed.exists() and (
            nbformat.read(executed, as_version=4).metadata.get("pagedkv", {}).get("source_sha256") == stamp
        )
        if not ok:
            stale.append(nb_path)
    if stale and os.environ.get("PAGEDKV_DOCS_EXECUTE") == "1":
        runner.DOCS_COPIES.mkdir(parents=True, exist_ok=True)
        with runner.kernel_env() as kernel:
            for nb_path in stale:
                result = runner.execute(nb_path, kernel)
                nbformat.write(result.executed, runner.DOCS_COPIES / nb_path.name)
        stale = []
    for nb_path in notebooks:
        target = dst / nb_path.name
        if nb_path in stale:
            nb = nbformat.read(nb_path, as_version=4)
            nb.cells.insert(1, nbformat.v4.new_markdown_cell(NOT_EXECUTED))
            data = nbformat.writes(nb).encode()
        else:
            data = (runner.DOCS_COPIES / nb_path.name).read_bytes()
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
    for old in dst.glob("*.ipynb"):
        if old.name not in {nb.name for nb in notebooks}:
            old.unlink()


_copy_tutorials()
