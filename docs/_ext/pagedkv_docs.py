"""Sphinx extension for the pagedkv docs: API-reference bookkeeping and the performance page.

Two jobs:

* Each public object is documented once, under the name users import. A package's ``__all__``
  re-exports (``kvblocks.BlockManager``) are documented on the package page, so the module that
  defines them (``kvblocks.manager``) leaves them out, and a package does not repeat what it
  re-exports from a sibling distribution. The lists are computed here and handed to the
  autosummary module template as ``pagedkv_exclude``.
* ``pagedkv-performance``: a directive that renders every ``docs/performance/*.json`` result
  (the last JSON line a benchmark printed, committed with its hardware, versions, commit and
  command) as tables, draws plots from the figures with matplotlib, and shows any image committed
  beside the JSON. The page builds, saying so, when no result is committed yet.
"""

from __future__ import annotations

import importlib
import json
import math
import pkgutil
import re
import sys
import types
from pathlib import Path
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.parsing import nested_parse_to_nodes

logger = logging.getLogger(__name__)

# Keys of a result file that describe the run rather than hold a figure.
META_KEYS = (
    "benchmark",
    "title",
    "name",
    "description",
    "command",
    "hardware",
    "gpu",
    "device",
    "cpu",
    "model",
    "workload",
    "versions",
    "commit",
    "date",
    "timestamp",
    "setup",
    "notes",
    "plot",
    "plots",
)
IMAGE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg")
# x-axis candidates for plotting a list of rows, most preferred first
X_HINTS = (
    "request_rate",
    "rate",
    "qps",
    "batch",
    "batch_size",
    "context",
    "context_len",
    "block_size",
)


# --------------------------------------------------------------------------------------------
# API reference bookkeeping
# --------------------------------------------------------------------------------------------


def _walk_modules(package: types.ModuleType) -> list[types.ModuleType]:
    """The package and every submodule autosummary will document (never ``__main__``)."""
    found = [package]
    for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
        leaf = info.name.rsplit(".", 1)[-1]
        if leaf == "__main__" or any(p.startswith("_") for p in info.name.split(".")[1:]):
            continue
        try:
            found.append(importlib.import_module(info.name))
        except Exception as exc:  # reported by autosummary itself, with the traceback
            logger.debug("cannot import %s: %s", info.name, exc)
    return found


def _guard_main_modules(package: types.ModuleType) -> None:
    """Keep autosummary from importing (and so running) a package's ``__main__`` module.

    autosummary imports every submodule it lists, private ones included; a ``__main__.py``
    would run its command line with Sphinx's arguments. A placeholder that autosummary treats
    as mocked stands in for it.
    """
    for path in getattr(package, "__path__", []):
        for main in Path(path).rglob("__main__.py"):
            rel = main.relative_to(path).with_suffix("").parts
            name = ".".join((package.__name__, *rel))
            if name not in sys.modules:
                stub = types.ModuleType(name, "placeholder: __main__ modules are not documented")
                stub.__sphinx_mock__ = True  # type: ignore[attr-defined]
                sys.modules[name] = stub


def compute_exclusions(package_names: list[str]) -> dict[str, list[str]]:
    """Members each module page leaves out, so that every object is documented exactly once."""
    exclude: dict[str, list[str]] = {}
    for pkg_name in package_names:
        try:
            package = importlib.import_module(pkg_name)
        except ImportError as exc:
            logger.warning("cannot import %s for its API reference: %s", pkg_name, exc)
            continue
        _guard_main_modules(package)
        modules = _walk_modules(package)
        public = list(getattr(package, "__all__", []))
        documented_here: set[tuple[str, str]] = set()
        foreign: list[str] = []
        for name in public:
            obj = getattr(package, name, None)
            mod = getattr(obj, "__module__", None)
            qual = getattr(obj, "__qualname__", None)
            if obj is None or isinstance(obj, types.ModuleType) or mod is None or qual is None:
                continue
            if getattr(obj, "__name__", name) != name and obj.__name__ in public:
                foreign.append(name)  # an alias (GuidedDecodingParams): its class is documented
            elif mod == pkg_name or mod.startswith(pkg_name + "."):
                documented_here.add((mod, qual))
            else:  # re-exported from a sibling distribution: documented on its own page
                foreign.append(name)
        if foreign:
            exclude[pkg_name] = sorted(foreign)
        for module in modules[1:]:
            names = sorted(
                name
                for name, obj in vars(module).items()
                if (
                    getattr(obj, "__module__", None) == module.__name__
                    or name in getattr(module, "__all__", ())  # a subpackage's re-export
                )
                and (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
                in documented_here
            )
            if names:
                exclude[module.__name__] = names
    return exclude


# --------------------------------------------------------------------------------------------
# Docstrings written in Markdown habits
# --------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+\S")
_SINGLE_TICKS = re.compile(r"(?<![`:\w\\])`([^`\n]+?)`(?![`_\w])")


def markdownish_to_rst(lines: list[str]) -> list[str]:
    """Rewrite the Markdown habits of a docstring into the reST that autodoc parses.

    The packages' docstrings are read by people first, and many use Markdown habits:
    ```` ``` ```` code fences, single-backtick code, lists right under a sentence. In reST these
    are a literal-string error, italics, and "unexpected indentation". This turns fences into
    code blocks, single backticks into inline literals (roles such as :class:`X` and links stay
    as they are), and puts the blank lines reST needs around lists. Valid reST passes unchanged.
    """
    out: list[str] = []
    fence_indent: str | None = None
    list_indent: int | None = None  # indentation of the current list's items, if in a list
    literal_base: int | None = (
        None  # indentation of a line ending in "::" (a literal block follows)
    )
    for line in lines:
        if literal_base is not None and line.strip():
            if len(line) - len(line.lstrip()) > literal_base:
                out.append(line)  # inside a reST literal block: leave it exactly as written
                continue
            literal_base = None
        if fence_indent is not None:  # inside a fence
            if line.strip() == "```":
                out.append("")
                fence_indent = None
            else:
                body = line[len(fence_indent) :] if line.startswith(fence_indent) else line.lstrip()
                out.append(fence_indent + "   " + body if body.strip() else "")
            continue
        m = _FENCE.match(line)
        if m:
            fence_indent = m.group(1)
            if out and out[-1].strip():
                out.append("")
            out += [f"{fence_indent}.. code-block:: {m.group(2) or 'text'}", ""]
            list_indent = None
            continue
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        item = _ITEM.match(line)
        if not stripped:
            out.append(line)
            continue
        if item:
            if list_indent is None and out and out[-1].strip():
                out.append("")  # a list needs a blank line before it
            list_indent = indent if list_indent is None else min(list_indent, indent)
        elif list_indent is not None and indent <= list_indent:
            if out and out[-1].strip():
                out.append("")  # and one after it
            list_indent = None
        out.append(_SINGLE_TICKS.sub(r"``\1``", line))
        if stripped.endswith("::"):
            literal_base = indent
    if fence_indent is not None:
        out.append("")
    return out


def _on_process_docstring(app, what, name, obj, options, lines: list[str]) -> None:
    lines[:] = markdownish_to_rst(lines)


def _on_config_inited(app: Sphinx, config: Config) -> None:
    names = [entry[0] for entry in config.pagedkv_packages]
    if not names or "autosummary_context" not in config:
        return
    context = dict(config.autosummary_context)
    context["pagedkv_exclude"] = compute_exclusions(names)
    config.autosummary_context = context


# --------------------------------------------------------------------------------------------
# Performance results
# --------------------------------------------------------------------------------------------


def _esc(text: Any) -> str:
    """Text made safe for reStructuredText inline content."""
    s = str(text)
    for ch in ("\\", "*", "`", "|", "_", "<", ">"):
        s = s.replace(ch, "\\" + ch)
    return s


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:,.4g}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(not isinstance(v, dict | list) for v in value):
        return ", ".join(_fmt(v) for v in value)
    if isinstance(value, dict) and all(not isinstance(v, dict | list) for v in value.values()):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return json.dumps(value)


def _images_of(path: Path) -> list[Path]:
    """Images committed for a result file: same stem, or the stem then ``_`` or ``-``."""
    return sorted(
        p
        for p in path.parent.iterdir()
        if p.suffix.lower() in IMAGE_SUFFIXES
        and (p.stem == path.stem or p.stem.startswith((path.stem + "_", path.stem + "-")))
    )


def _flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """Nested dicts as dotted keys: {"a": {"b": 1}} -> [("a.b", 1)]."""
    if isinstance(value, dict):
        return [kv for k, v in value.items() for kv in _flatten(f"{prefix}.{k}", v)]
    return [(prefix, value)]


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _list_table(header: list[str], rows: list[list[str]], title: str = "") -> list[str]:
    lines = [f".. list-table:: {title}".rstrip(), "   :header-rows: 1", ""]
    for row in [header, *rows]:
        lines.append("   * - " + (row[0] or " "))
        lines.extend("     - " + (cell or " ") for cell in row[1:])
    lines.append("")
    return lines


class PerformanceDirective(SphinxDirective):
    """``pagedkv-performance``: every committed benchmark result, as tables and plots.

    An optional argument (a file name or glob under ``docs/performance/``, such as
    ``tensor_parallel.json``) renders only those results, for a page about one feature."""

    has_content = False
    required_arguments = 0
    optional_arguments = 1

    def run(self) -> list[nodes.Node]:
        perf_dir = Path(self.env.srcdir) / "performance"
        out_dir = perf_dir / "_generated"
        pattern = self.arguments[0] if self.arguments else None
        files = sorted(perf_dir.glob(pattern or "*.json"))
        lines: list[str] = []
        if not files and pattern:
            lines += [
                f"``docs/performance/{pattern}`` is not committed yet: it shows up here on",
                "the next build once measured.",
                "",
            ]
        elif not files:
            lines += [
                "No measured result is committed yet. Each benchmark's GPU result lands as one JSON",
                "file under ``docs/performance/`` and shows up here on the next build.",
                "",
            ]
        used_images: set[Path] = set()
        for path in files:
            self.env.note_dependency(str(path))
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                lines += [
                    f".. error:: ``{path.name}`` is not valid JSON: {_esc(exc)}",
                    "",
                ]
                continue
            if not isinstance(data, dict):
                data = {"results": data}
            rendered = self._render_result(path, data, out_dir, used_images)
            if pattern is not None:  # a title, not a section: the performance page has that
                rendered = [f"**{rendered[0]}**", *rendered[2:]]
            lines += rendered
        others = [
            p
            for p in sorted(perf_dir.iterdir())
            if p.suffix.lower() in IMAGE_SUFFIXES and p not in used_images and pattern is None
        ]
        if others:
            lines += ["Other plots", "-----------", ""]
            for image in others:
                lines += self._image(image, caption=image.stem.replace("_", " "))
        text = "\n".join(lines)
        if type(self.state).__module__.startswith("myst_parser"):
            # In a MyST page the nested content is parsed as Markdown: hand it over as reST.
            text = "```{eval-rst}\n" + text + "\n```\n"
        return nested_parse_to_nodes(
            self.state, text, source=str(self.get_source_info()[0]), allow_section_headings=True
        )

    # -- one result file --------------------------------------------------------------------

    def _render_result(
        self, path: Path, data: dict[str, Any], out_dir: Path, used_images: set[Path]
    ) -> list[str]:
        title = str(data.get("title") or data.get("benchmark") or data.get("name") or path.stem)
        lines = [_esc(title), "-" * max(len(_esc(title)), 3), ""]
        if data.get("description"):
            lines += [_esc(data["description"]), ""]
        lines += [f"Result file: ``docs/performance/{path.name}``", ""]
        command = data.get("command")
        if command:
            cmd = command if isinstance(command, str) else " ".join(map(str, command))
            lines += ["Command:", "", ".. code-block:: bash", "", f"   {cmd}", ""]
        setup: list[tuple[str, Any]] = []
        for key in META_KEYS:
            if key in data and key not in (
                "title", "benchmark", "name", "description", "command", "plot", "plots",
            ):  # fmt: skip
                if key == "setup" and isinstance(data[key], dict):
                    setup += [(k.split(".", 1)[1], v) for k, v in _flatten(key, data[key])]
                else:
                    setup.append((key, data[key]))
        committed = [p for p in sorted(_images_of(path)) if p.suffix.lower() in IMAGE_SUFFIXES]
        self._draw = not committed  # a committed plot is the one to show, not a redrawn one
        if setup:
            lines += _list_table(
                ["setup", ""], [[_esc(k), _esc(_fmt(v))] for k, v in setup], "Setup"
            )
        figures = {k: v for k, v in data.items() if k not in META_KEYS}
        scalars = [(k, v) for k, v in figures.items() if _is_scalar(v)]
        # A dict of figures may mix scalars with lists of rows (a sweep): split the two.
        flat_dicts: dict[str, dict] = {}
        sweeps: dict[str, list[dict]] = {}
        for k, v in figures.items():
            if not isinstance(v, dict) or not v or all(isinstance(x, dict) for x in v.values()):
                continue
            scalars_of_k = {a: b for a, b in v.items() if _is_scalar(b)}
            if scalars_of_k:
                flat_dicts[k] = scalars_of_k
            for a, b in v.items():
                if isinstance(b, list) and b and all(isinstance(r, dict) for r in b):
                    sweeps.setdefault(a, []).extend({"series": k, **r} for r in b)
        # Sibling dicts with the same keys (one per policy, say) make one table together.
        by_keys: dict[tuple[str, ...], dict[str, dict]] = {}
        for key, sub in flat_dicts.items():
            by_keys.setdefault(tuple(sub), {})[key] = sub
        grouped = [group for group in by_keys.values() if len(group) >= 2]
        for group in by_keys.values():
            if len(group) < 2:
                for key, sub in group.items():
                    scalars += [(f"{key}.{k}", v) for k, v in sub.items()]
        if scalars:
            lines += _list_table(
                ["figure", "value"], [[f"``{k}``", _esc(_fmt(v))] for k, v in scalars], "Figures"
            )
        for group in grouped:
            name = "by " + ", ".join(group)[:60]
            lines += self._dict_of_dicts(path, "_".join(group)[:60], group, out_dir, title=name)
        for key, rows in sweeps.items():
            lines += self._rows(path, key, rows, out_dir)
        for key, value in figures.items():
            if (
                isinstance(value, dict)
                and value
                and all(isinstance(v, dict) for v in value.values())
            ):
                lines += self._dict_of_dicts(path, key, value, out_dir)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                lines += self._rows(path, key, value, out_dir)
        images = [data.get("plot")] if isinstance(data.get("plot"), str) else []
        images += (
            [p for p in data.get("plots", []) if isinstance(p, str)]
            if isinstance(data.get("plots"), list)
            else []
        )
        for name in images:
            image = (path.parent / name).resolve()
            if image.exists():
                used_images.add(image)
                lines += self._image(image, caption=f"{_esc(title)} ({_esc(name)})")
            else:
                lines += [
                    f".. warning:: ``{path.name}`` names a plot ``{name}`` that is not committed.",
                    "",
                ]
        for image in sorted(_images_of(path)):
            if image.suffix.lower() in IMAGE_SUFFIXES and image.resolve() not in used_images:
                used_images.add(image.resolve())
                lines += self._image(image, caption=_esc(image.stem.replace("_", " ")))
        return lines

    def _dict_of_dicts(
        self, path: Path, key: str, value: dict[str, dict], out_dir: Path, title: str = ""
    ) -> list[str]:
        columns: list[str] = []
        for sub in value.values():
            columns += [c for c, v in sub.items() if c not in columns and _is_scalar(v)]
        rows = [
            [f"**{_esc(name)}**", *(_esc(_fmt(sub.get(c))) for c in columns)]
            for name, sub in value.items()
        ]
        lines = _list_table([" ", *(f"``{c}``" for c in columns)], rows, _esc(title or key))
        numeric = [c for c in columns if all(_is_number(sub.get(c)) for sub in value.values())]
        if numeric and self._draw:
            image = self._bar_plot(path, key, value, numeric, out_dir)
            if image is not None:
                lines += self._image(image, caption=f"{_esc(title or key)}, from ``{path.name}``")
        return lines

    def _rows(self, path: Path, key: str, rows: list[dict], out_dir: Path) -> list[str]:
        columns: list[str] = []
        for row in rows:
            columns += [c for c, v in row.items() if c not in columns and _is_scalar(v)]
        body = [[_esc(_fmt(row.get(c))) for c in columns] for row in rows]
        lines = _list_table([f"``{c}``" for c in columns], body, _esc(key))
        numeric = [c for c in columns if all(_is_number(r.get(c)) for r in rows if c in r)]
        if len(numeric) >= 2 and self._draw:
            image = self._line_plot(path, key, rows, columns, numeric, out_dir)
            if image is not None:
                lines += self._image(image, caption=f"{_esc(key)}, from ``{path.name}``")
        return lines

    # -- plots --------------------------------------------------------------------------------

    @staticmethod
    def _pyplot():
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.info("matplotlib is not installed: the performance page has no plots")
            return None
        return plt

    def _bar_plot(self, path: Path, key: str, value: dict, numeric: list[str], out_dir: Path):
        plt = self._pyplot()
        if plt is None:
            return None
        numeric = numeric[:4]
        fig, axes = plt.subplots(1, len(numeric), figsize=(3.2 * len(numeric), 2.8), squeeze=False)
        names = list(value)
        for ax, column in zip(axes[0], numeric):
            ax.bar(names, [value[n][column] for n in names], color="#4c72b0")
            ax.set_title(column, fontsize=9)
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        fig.tight_layout()
        return self._save(fig, plt, out_dir / f"{path.stem}__{key}.png")

    def _line_plot(
        self,
        path: Path,
        key: str,
        rows: list[dict],
        columns: list[str],
        numeric: list[str],
        out_dir: Path,
    ):
        plt = self._pyplot()
        if plt is None:
            return None
        x = next((c for hint in X_HINTS for c in numeric if c == hint), None)
        x = x or next((c for c in numeric if any(h in c for h in X_HINTS)), numeric[0])
        ys = [c for c in numeric if c != x][:4]
        group = next(
            (
                c
                for c in columns
                if c not in numeric and all(isinstance(r.get(c), str) for r in rows)
            ),
            None,
        )
        groups: dict[str, list[dict]] = {}
        for row in rows:
            groups.setdefault(str(row.get(group, "")) if group else "", []).append(row)
        for members in groups.values():
            xs = [r.get(x) for r in members]
            if len(set(xs)) != len(xs):
                # several rows per x in one series (another varying column): a line through
                # them would mean nothing, so the table stands alone
                return None
        fig, axes = plt.subplots(1, len(ys), figsize=(3.6 * len(ys), 3.0), squeeze=False)
        for ax, y in zip(axes[0], ys):
            for label, members in groups.items():
                pts = sorted(
                    (r[x], r[y]) for r in members if _is_number(r.get(x)) and _is_number(r.get(y))
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label or None)
            ax.set_xlabel(x, fontsize=8)
            ax.set_title(y, fontsize=9)
            if group:
                ax.legend(fontsize=7)
        fig.tight_layout()
        return self._save(fig, plt, out_dir / f"{path.stem}__{key}.png")

    @staticmethod
    def _save(fig, plt, target: Path) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110)
        plt.close(fig)
        return target

    def _image(self, image: Path, caption: str) -> list[str]:
        rel = "/" + image.resolve().relative_to(Path(self.env.srcdir).resolve()).as_posix()
        return [f".. figure:: {rel}", "   :width: 90%", "", f"   {caption}", ""]


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.autodoc")  # for its autodoc-process-docstring event
    app.add_config_value("pagedkv_packages", [], "env", types=[list])
    app.connect("config-inited", _on_config_inited)
    # before napoleon (priority 500), so its sections see clean reST
    app.connect("autodoc-process-docstring", _on_process_docstring, priority=400)
    app.add_directive("pagedkv-performance", PerformanceDirective)
    return {"version": "0.1", "parallel_read_safe": True, "parallel_write_safe": True}
