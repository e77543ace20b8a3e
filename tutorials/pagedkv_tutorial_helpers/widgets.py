"""Widget plumbing: controls that call a notebook's function again, a slider over results.

Both keep what they show in plain attributes (``.view.value``, ``.result``, ``.error``), so the
test suite can set a control's value and check what the notebook would show.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv_tutorial_helpers.plots import figure_html


def to_html(obj: Any) -> str:
    """HTML of what a notebook function returned: a string (HTML already), a matplotlib
    figure, anything with ``_repr_html_`` (``IPython.display.HTML``), or a list of those."""
    if obj is None:
        return ""
    if isinstance(obj, str):
        return obj
    if isinstance(obj, list | tuple):
        return "".join(to_html(o) for o in obj)
    if hasattr(obj, "savefig"):
        return figure_html(obj)
    if hasattr(obj, "_repr_html_"):
        return obj._repr_html_() or ""
    return f"<pre>{html.escape(repr(obj))}</pre>"


def _control(name: str, spec: Any):
    """An ipywidgets control from a short spec, as ``ipywidgets.interact`` reads them:
    ``(min, max)`` or ``(min, max, step)`` -> an int slider starting at ``min`` (``value=``
    a given start: ``(min, max, step, value)``), a list -> a dropdown (first item selected), a
    bool -> a checkbox, a widget -> itself. Dropdown items may be ``(label, value)`` pairs."""
    import ipywidgets as w

    style = {"description_width": "initial"}
    if isinstance(spec, w.ValueWidget):
        return spec
    if isinstance(spec, bool):
        return w.Checkbox(value=spec, description=name)
    if isinstance(spec, tuple) and 2 <= len(spec) <= 4 and all(isinstance(x, int) for x in spec):
        lo, hi = spec[0], spec[1]
        step = spec[2] if len(spec) > 2 else 1
        value = spec[3] if len(spec) > 3 else lo
        return w.IntSlider(value=value, min=lo, max=hi, step=step, description=name,
                           continuous_update=False, style=style)  # fmt: skip
    if isinstance(spec, list) and spec:
        # index, not value: a first choice whose value is None ("default") given as value=None
        # means "nothing selected" to ipywidgets, and picking it later would change nothing
        return w.Dropdown(options=spec, index=0, description=name, style=style)
    raise ValueError(
        f"control {name!r}: give (min, max[, step[, value]]) ints, a list of choices, a bool "
        f"or an ipywidgets control, not {spec!r}"
    )


class Rerun:
    """Controls whose every change calls ``run(**values)`` again and shows its result.

    ``run`` is a function of the notebook (it runs the real engine, block manager or kernel);
    its return value is drawn into ``self.view`` (see :func:`to_html`). When a moved control
    makes it fail, the exception is shown instead, its message kept in ``self.error`` (a
    ``ValueError``, a setting the package refuses, by its message alone). The first run, with
    the controls' defaults, raises: a notebook whose own defaults fail is broken, and "run
    all" (and the tests) must stop there rather than show an error in a widget.
    """

    def __init__(self, run: Callable[..., Any], **controls: Any) -> None:
        import ipywidgets as w

        self.run = run
        self.controls = {name: _control(name, spec) for name, spec in controls.items()}
        self.view = w.HTML()
        self.view.add_class("pagedkv-view")
        self.status = w.HTML()
        self.result: Any = None
        self.error: str | None = None
        self.runs = 0
        for control in self.controls.values():
            control.observe(self._on_change, names="value")
        self.refresh(first=True)
        self.widget = w.VBox([w.HBox(list(self.controls.values())), self.status, self.view])

    @property
    def values(self) -> dict[str, Any]:
        return {name: c.value for name, c in self.controls.items()}

    def _on_change(self, change: dict[str, Any]) -> None:
        self.refresh()

    def refresh(self, first: bool = False) -> None:
        """Call ``run`` with the controls' values now and redraw (``first``: errors raise)."""
        import ipywidgets as w

        self.status.value = "<i>running…</i>"
        try:
            self.result = self.run(**self.values)
        except Exception as exc:  # shown where the view was; ValueError: a refused setting
            if first:
                raise
            self.error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            self.result = None
            self.status.value = ""
            self.view.value = (
                f'<p class="pagedkv-error" style="color:#c44e52">{html.escape(self.error)}</p>'
            )
            return
        self.error = None
        self.runs += 1
        self.view.value = to_html(self.result)  # the view first: a changed status means a new view
        settings = ", ".join(
            f"{k}={c.label if isinstance(c, w.Dropdown) else c.value}" for k, c in self.controls.items()
        )
        self.status.value = f'<small class="pagedkv-run">run {self.runs}: {html.escape(settings)}</small>'

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


class Player:
    """A step slider with a Play button over ``items``; ``render(item)`` draws one.

    ``start`` is an index into ``items``. ``first``: the number the slider shows for the first
    item (the rest count up from it): pass the first record's engine step, so that the slider
    and the view's title name the same step."""

    def __init__(self, items: Sequence[Any], render: Callable[[Any], Any], *, start: int = 0,
                 interval_ms: int = 600, description: str = "step", first: int = 0) -> None:  # fmt: skip
        import ipywidgets as w

        if not items:
            raise ValueError("Player needs at least one item to show")
        self.items = list(items)
        self.render = render
        self.first = first
        last = len(self.items) - 1
        start = max(0, min(start, last))
        self.play = w.Play(value=first + start, min=first, max=first + last, interval=interval_ms)
        self.slider = w.IntSlider(value=first + start, min=first, max=first + last,
                                  description=description)  # fmt: skip
        w.jslink((self.play, "value"), (self.slider, "value"))
        self.view = w.HTML()
        self.view.add_class("pagedkv-view")
        self.slider.observe(self._on_change, names="value")
        self.show(start)
        self.widget = w.VBox([w.HBox([self.play, self.slider]), self.view])

    def _on_change(self, change: dict[str, Any]) -> None:
        self.show(change["new"] - self.first)

    def show(self, index: int) -> None:
        self.index = index
        self.view.value = to_html(self.render(self.items[index]))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
