"""Shared pieces of the notebook dashboards: PNG rendering without pyplot, tables, display."""

from __future__ import annotations

import base64
import functools
import html
import io
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from carlskit._checks import finite_float

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def render_png(draw: Callable[[Figure], None], width_inches: float, height_inches: float,
               dpi: int = 90) -> bytes:
    """PNG bytes of a figure drawn by ``draw``. Uses ``matplotlib.figure.Figure`` with the Agg
    canvas directly: thread-safe, never registered with pyplot, freed when done."""
    figure = Figure(figsize=(width_inches, height_inches), dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    try:
        draw(figure)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", metadata={"Software": None})
        return buffer.getvalue()
    finally:
        figure.clear()


@functools.lru_cache(maxsize=8)
def placeholder_png(text: str, width_inches: float = 6.0, height_inches: float = 0.5) -> bytes:
    """A small PNG saying ``text``: an image widget's value before its first frame (an empty
    ``ipywidgets.Image`` shows the browser's broken-image icon)."""

    def draw(figure: Figure) -> None:
        figure.text(0.5, 0.5, text, ha="center", va="center", color="0.45", style="italic")

    return render_png(draw, width_inches, height_inches)


def check_smoothing(weight: Any, name: str = "smoothing") -> float:
    """``weight`` as a float in [0, 1) (the EMA weight of :func:`smooth`), else a TypeError (not a
    number) or ValueError naming it."""
    if not 0.0 <= finite_float(weight, name) < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {weight!r}")
    return float(weight)


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average (as TensorBoard's smoothing slider):
    ``m_t = w m_{t-1} + (1 - w) x_t``, shown as ``m_t / (1 - w^t)``, for 1-D ``values`` and
    ``weight`` in [0, 1). Non-finite points are skipped (they keep the running average)."""
    weight = check_smoothing(weight, "weight")
    try:
        values = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"values must be a 1-D sequence of numbers: {error}") from None
    if values.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {values.shape}")
    if weight == 0 or values.size == 0:
        return values
    out = np.empty_like(values)
    average, count = 0.0, 0
    for index, value in enumerate(values.tolist()):
        if np.isfinite(value):
            average = weight * average + (1 - weight) * value
            count += 1
        out[index] = average / (1 - weight**count) if count else np.nan
    return out


def png_img_tag(png: bytes, alt: str) -> str:
    if not png:
        return f"<p><i>{html.escape(alt)}: no data yet</i></p>"
    encoded = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}"/>'


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def html_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "<p><i>none</i></p>"
    columns = list(columns or _columns_of(rows))
    head = "".join(f"<th>{html.escape(str(name))}</th>" for name in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(row.get(name, '')))}</td>" for name in columns) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def text_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "  (none)"
    columns = list(columns or _columns_of(rows))
    cells = [columns] + [[_cell(row.get(name, "")) for name in columns] for row in rows]
    widths = [max(len(str(line[i])) for line in cells) for i in range(len(columns))]
    return "\n".join("  " + "  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip()
                     for line in cells)


def _columns_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns.extend(name for name in row if name not in columns)
    return columns


class FinalFrame:
    """A display that can be brought up to date once its live updates end.

    A widget view alone is saved as nothing a reader can see (a notebook saved without widget
    state, nbconvert, a documentation page): the same display bundle carries static fallbacks
    (a PNG, HTML, text), rendered when it was displayed. :meth:`show` displays the bundle with a
    display id; :meth:`update` replaces it with a fresh bundle, so the saved output shows the last
    frame. Both only ever run in the kernel's main thread (``update`` does nothing elsewhere):
    threads set widget values, never display.
    """

    def __init__(self):
        self._handle: Any = None

    @staticmethod
    def bundle(widget: Any, fallbacks: dict[str, Any]) -> dict[str, Any]:
        """A display bundle: ``widget``'s view (when it has one) beside its static ``fallbacks``
        (``{"text/plain": ..., "text/html": ..., "image/png": base64}``)."""
        bundle = dict(fallbacks)
        view = widget._repr_mimebundle_().get(WIDGET_VIEW)
        if view is not None:
            bundle[WIDGET_VIEW] = view
        return bundle

    def show(self, bundle: dict[str, Any]) -> None:
        from IPython.display import display

        self._handle = display(bundle, raw=True, display_id=True)

    def update(self, bundle: Callable[[], dict[str, Any]]) -> bool:
        """Replace the shown bundle with ``bundle()``; False (nothing done) if never shown or not in
        the main thread."""
        if self._handle is None or threading.current_thread() is not threading.main_thread():
            return False
        self._handle.update(bundle(), raw=True)
        return True


class WidgetDisplay:
    """Mixin: in a notebook show ``self.widget`` (an ipywidgets container), and give front ends
    without widget support (nbconvert, GitHub, a plain terminal) HTML and text fallbacks in the
    same display bundle; :meth:`show_final_frame` (called by ``stop()``) brings those fallbacks
    up to date, so a saved notebook shows the last frame, not the first."""

    widget: Any

    def _on_display(self) -> None:
        """Hook run when the object is displayed (start background updates)."""

    def _repr_html_(self) -> str:  # pragma: no cover - every subclass overrides
        return html.escape(repr(self))

    def _bundle(self) -> dict[str, Any]:
        return FinalFrame.bundle(self.widget, {"text/plain": repr(self), "text/html": self._repr_html_()})

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, Any]:
        self._on_display()
        return self._bundle()

    def _ipython_display_(self) -> None:
        self._on_display()
        if not hasattr(self, "_final_frame"):
            self._final_frame = FinalFrame()
        self._final_frame.show(self._bundle())

    def show_final_frame(self) -> bool:
        """Bring the displayed fallbacks (HTML, text) up to the current frame; main thread only.
        Returns whether a display was updated."""
        final_frame = getattr(self, "_final_frame", None)
        return final_frame is not None and final_frame.update(self._bundle)


class PeriodicThread:
    """Calls ``action`` every ``every_seconds`` on a daemon thread until stopped."""

    def __init__(self, action: Callable[[], None], every_seconds: float, name: str):
        self._action = action
        self.every_seconds = every_seconds
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._action()
            self._stop.wait(self.every_seconds)

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()


class Panels(WidgetDisplay):
    """Several live views shown as one, stacked (an ``ipywidgets.VBox`` of their widgets), with
    their static fallbacks one after another: each part's HTML, or the PNG of an image widget."""

    def __init__(self, parts: Sequence[Any]):
        import ipywidgets

        self.parts = list(parts)
        self.widget = ipywidgets.VBox([part.widget for part in self.parts])

    def _on_display(self) -> None:
        for part in self.parts:
            if hasattr(part, "_on_display"):
                part._on_display()

    def _repr_html_(self) -> str:
        pieces = []
        for part in self.parts:
            if hasattr(part, "_repr_html_"):
                pieces.append(part._repr_html_())
            elif isinstance(getattr(part.widget, "value", None), bytes):
                pieces.append(png_img_tag(bytes(part.widget.value), type(part).__name__))
        return "<div>" + "".join(pieces) + "</div>"

    def __repr__(self) -> str:
        return "\n".join(repr(part) for part in self.parts)
