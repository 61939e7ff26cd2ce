"""``LiveSummaries``: a plot of scalar summaries that updates in place while training runs."""

from __future__ import annotations

import html
import math
import os
import threading
import time
from collections.abc import Sequence

import ipywidgets

from carlskit._checks import integer, positive_float, positive_int
from carlskit.summaries import SummaryReader
from carlskit.widgets._display import (
    PeriodicThread,
    WidgetDisplay,
    check_smoothing,
    html_table,
    placeholder_png,
    png_img_tag,
    render_png,
    smooth,
    text_table,
)


class LiveSummaries(WidgetDisplay):
    """Live line plots of scalar summaries, read incrementally from a log directory.

    A background thread (started when the object is displayed, or by :meth:`start`) reads new
    points every ``every_seconds`` and, when something changed, renders one PNG with
    ``matplotlib.figure.Figure`` and assigns it to an ``ipywidgets.Image``: the plot changes in
    place, with no ``display()`` from threads and no figure left open. Controls: smoothing
    (debiased EMA weight), log-scale y axis, pause. Each panel plots at most ``max_points`` points,
    read from the subsampled copies when a summary is longer.

    Args:
      source: a :class:`~carlskit.summaries.SummaryReader` or a log directory.
      names: scalar names to plot; ``None`` plots every scalar (up to ``max_panels``).
      every_seconds: refresh period of the background thread.
      max_points: points per panel (subsampled copies beyond this).
      smoothing: initial smoothing weight in [0, 1).
      log_scale: initial log-scale y axes.
    """

    def __init__(
        self,
        source: SummaryReader | str | os.PathLike,
        names: Sequence[str] | None = None,
        *,
        every_seconds: float = 1.0,
        max_points: int = 2_000,
        max_panels: int = 6,
        smoothing: float = 0.0,
        log_scale: bool = False,
        width_inches: float = 8.0,
        panel_height_inches: float = 2.6,
    ):
        if isinstance(source, SummaryReader):
            self.reader = source
        elif isinstance(source, (str, os.PathLike)):
            self.reader = SummaryReader(source, on_corrupt="skip")
        else:
            raise TypeError(f"source must be a SummaryReader or a log directory, got {type(source).__name__}")
        if names is not None:
            if isinstance(names, str) or not all(isinstance(name, str) for name in names):
                raise TypeError("names must be a sequence of str (or None for every scalar)")
            names = list(names)
        self.names = names
        positive_float(every_seconds, "every_seconds")
        integer(max_points, "max_points", minimum=2)
        positive_int(max_panels, "max_panels")
        smoothing = check_smoothing(smoothing)
        self.max_points, self.max_panels = int(max_points), int(max_panels)
        self.width_inches, self.panel_height_inches = width_inches, panel_height_inches
        self._render_lock = threading.Lock()
        self._signature: tuple | None = None
        self.latest: dict[str, dict[str, float]] = {}
        self.renders = 0

        self.image = ipywidgets.Image(value=placeholder_png("waiting for the first summaries"), format="png",
                                      layout=ipywidgets.Layout(width="100%", max_width="900px"))
        self.smoothing_slider = ipywidgets.FloatSlider(
            value=smoothing, min=0.0, max=0.999, step=0.01, description="smoothing",
            continuous_update=False)
        self.log_scale_checkbox = ipywidgets.Checkbox(value=log_scale, description="log scale", indent=False)
        self.pause_button = ipywidgets.ToggleButton(value=False, description="pause", icon="pause")
        self.status = ipywidgets.Label(value="waiting for data")
        self.widget = ipywidgets.VBox([
            ipywidgets.HBox([self.smoothing_slider, self.log_scale_checkbox, self.pause_button]),
            self.image, self.status,
        ])
        for control in (self.smoothing_slider, self.log_scale_checkbox):
            control.observe(self._on_setting_change, names="value")
        self.pause_button.observe(self._on_pause_change, names="value")
        self._updater = PeriodicThread(self._background_update, every_seconds, "carlskit-live-summaries")

    @property
    def png(self) -> bytes:
        """The PNG currently shown; empty before the first frame (the widget shows a placeholder)."""
        return bytes(self.image.value) if self.renders else b""

    # -- settings ------------------------------------------------------------------------------
    @property
    def smoothing(self) -> float:
        return float(self.smoothing_slider.value)

    @smoothing.setter
    def smoothing(self, weight: float) -> None:
        self.smoothing_slider.value = check_smoothing(weight)

    @property
    def log_scale(self) -> bool:
        return bool(self.log_scale_checkbox.value)

    @log_scale.setter
    def log_scale(self, enabled: bool) -> None:
        self.log_scale_checkbox.value = bool(enabled)

    @property
    def paused(self) -> bool:
        return bool(self.pause_button.value)

    def pause(self) -> None:
        """Stop redrawing (data keeps accumulating on disk); :meth:`resume` catches up."""
        self.pause_button.value = True

    def resume(self) -> None:
        self.pause_button.value = False

    def _on_setting_change(self, change) -> None:
        if not self.paused:
            self.update()

    def _on_pause_change(self, change) -> None:
        self.pause_button.description = "resume" if change["new"] else "pause"
        self.pause_button.icon = "play" if change["new"] else "pause"
        if not change["new"]:
            self.update()

    # -- updating ------------------------------------------------------------------------------
    def _plotted_names(self) -> list[str]:
        names = self.names if self.names is not None else self.reader.names("scalars")
        return names[: self.max_panels]

    def update(self) -> bool:
        """Read new points and redraw if anything changed; return whether the image changed.
        Does nothing while paused."""
        if self.paused:
            return False
        with self._render_lock:
            names = self._plotted_names()
            frames = {name: self.reader.scalars(name, max_points=self.max_points) for name in names}
            signature = (tuple((name, len(frame), frame["step"].iat[-1] if len(frame) else None)
                               for name, frame in frames.items()), self.smoothing, self.log_scale)
            if signature == self._signature:
                return False
            png = render_png(lambda figure: self._draw(figure, frames), self.width_inches,
                             self.panel_height_inches * max(1, math.ceil(len(names) / 2)))
            self.latest = {
                name: {"step": int(frame["step"].iat[-1]), "value": float(frame["value"].iat[-1])}
                for name, frame in frames.items() if len(frame)
            }
            changed = png != self.png
            self.image.value = png
            self._signature = signature
            self.renders += 1
            self.status.value = self._status_line()
            return changed

    def _background_update(self) -> None:
        try:
            self.update()
        except Exception as error:  # keep the thread alive; show what went wrong
            self.status.value = f"update failed: {error!r}"

    def _status_line(self) -> str:
        if not self.latest:
            return "waiting for data"
        parts = [f"{name} = {row['value']:.4g} @ {row['step']}" for name, row in self.latest.items()]
        return f"{time.strftime('%H:%M:%S')}  " + "   ".join(parts)

    def _draw(self, figure, frames) -> None:
        names = list(frames)
        if not names:
            axes = figure.add_subplot(1, 1, 1)
            axes.text(0.5, 0.5, "no scalar summaries yet", ha="center", va="center")
            axes.set_axis_off()
            return
        columns = 1 if len(names) == 1 else 2
        rows = math.ceil(len(names) / columns)
        for index, name in enumerate(names):
            axes = figure.add_subplot(rows, columns, index + 1)
            frame = frames[name]
            steps, values = frame["step"].to_numpy(), frame["value"].to_numpy()
            if self.smoothing > 0:
                axes.plot(steps, values, color="tab:blue", alpha=0.25, linewidth=1)
                axes.plot(steps, smooth(values, self.smoothing), color="tab:blue", linewidth=1.5)
            else:
                axes.plot(steps, values, color="tab:blue", linewidth=1.2)
            if self.log_scale:
                axes.set_yscale("log", nonpositive="mask")
            axes.set_title(name, fontsize=10)
            axes.set_xlabel("step", fontsize=8)
            axes.tick_params(labelsize=8)
            axes.grid(True, alpha=0.3)

    def start(self) -> LiveSummaries:
        """Start the background updates (idempotent)."""
        self._updater.start()
        return self

    def stop(self) -> None:
        """Stop the background updates; from the notebook's main thread, also read the last points
        and make the displayed output's static frame (what a saved notebook shows) the last one."""
        self._updater.stop()
        if threading.current_thread() is threading.main_thread() and getattr(self, "_final_frame", None):
            self.update()
            self.show_final_frame()

    @property
    def running(self) -> bool:
        return self._updater.running

    def close(self) -> None:
        """Stop updating and close the widgets."""
        self.stop()
        self.widget.close()

    # -- display -------------------------------------------------------------------------------
    def _on_display(self) -> None:
        if self._signature is None:
            self._background_update()
        self.start()

    def _rows(self) -> list[dict]:
        return [{"summary": name, **row} for name, row in self.latest.items()]

    def _repr_html_(self) -> str:
        if not self.running:  # a static snapshot: read what is there now
            self._background_update()
        title = f"<b>LiveSummaries</b> {html.escape(str(self.reader.logdir))}"
        return f"<div>{title}<br/>{png_img_tag(self.png, 'summaries')}{html_table(self._rows())}</div>"

    def __repr__(self) -> str:
        state = "paused" if self.paused else ("running" if self.running else "stopped")
        names = self.names if self.names is not None else "all scalars"
        return (f"LiveSummaries({str(self.reader.logdir)!r}, names={names}, {state})\n"
                + text_table(self._rows(), ["summary", "step", "value"]))

