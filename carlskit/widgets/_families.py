"""``FamilyMonitor``: the meta-training learner's per-task-family figures, live, with the families
that diverge standing out (Metz et al. 2020, App. H.1: watch each family's loss and gradient variance)."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets
import numpy as np

from carlskit._checks import positive_float
from carlskit.widgets._display import PeriodicThread, WidgetDisplay, text_table

COLUMNS = ["task_family", "count", "loss_all", "loss_latest", "latest_over_all", "grad_variance",
           "variance_over_median", "flag"]


def flag_families(rows: Sequence[Mapping[str, Any]], *, loss_ratio: float = 1.5,
                  variance_ratio: float = 10.0) -> list[dict[str, Any]]:
    """``rows`` (the learner's ``status()["families"]``) with ``latest_over_all`` (latest loss over
    the family's mean so far), ``variance_over_median`` (its gradient variance over the median
    family's) and ``flag``: ``"diverging"`` when the first exceeds ``loss_ratio`` or the loss is not
    finite, ``"noisy"`` when the second exceeds ``variance_ratio``, else ``""``. Flagged first."""
    variances = [r.get("grad_variance") for r in rows if r.get("grad_variance") is not None]
    median = float(np.median(variances)) if variances else None
    out = []
    for row in rows:
        latest, mean, variance = row.get("loss_latest"), row.get("loss_all"), row.get("grad_variance")
        over = latest / mean if latest is not None and mean not in (None, 0) else None
        noisy = variance / median if variance is not None and median else None
        diverging = (latest is not None and not np.isfinite(latest)) or (over is not None and over > loss_ratio)
        flag = "diverging" if diverging else "noisy" if noisy is not None and noisy > variance_ratio else ""
        out.append({**row, "latest_over_all": over, "variance_over_median": noisy, "flag": flag})
    return sorted(out, key=lambda r: (r["flag"] == "", -(r["latest_over_all"] or 0.0)))


class FamilyMonitor(WidgetDisplay):
    """A live table of the learner's per-family loss and outer-gradient variance; families whose
    latest loss jumped above their mean (``diverging``) or whose gradient variance is far above the
    other families' (``noisy``) come first, in red.

    Args:
      source: an object with ``status()`` returning ``{"families": rows}`` (``MetaTraining``, a
        ``Learner``) or a callable returning the rows.
      every_seconds: refresh period once displayed; ``None``: only on :meth:`refresh`.
      loss_ratio, variance_ratio: the thresholds of :func:`flag_families`.
    """

    def __init__(self, source: Any, *, every_seconds: float | None = 2.0, loss_ratio: float = 1.5,
                 variance_ratio: float = 10.0):
        if not (hasattr(source, "status") or callable(source)):
            raise TypeError(f"source must have status() or be callable, got {type(source).__name__}")
        if every_seconds is not None:
            positive_float(every_seconds, "every_seconds")
        self.loss_ratio = positive_float(loss_ratio, "loss_ratio")
        self.variance_ratio = positive_float(variance_ratio, "variance_ratio")
        self.source, self.rows = source, []
        self.html = ipywidgets.HTML()
        self.widget = ipywidgets.VBox([self.html])
        self._updater = (PeriodicThread(self._background_refresh, every_seconds, "carlskit-family-monitor")
                         if every_seconds is not None else None)
        self.refresh()

    def _read(self) -> list[Mapping[str, Any]]:
        if hasattr(self.source, "status"):
            return list(self.source.status().get("families") or [])
        return list(self.source() or [])

    def refresh(self) -> list[dict[str, Any]]:
        """Read the rows again, flag them and redraw; returns the flagged rows."""
        self.rows = flag_families(self._read(), loss_ratio=self.loss_ratio, variance_ratio=self.variance_ratio)
        self.html.value = self._repr_html_()
        return self.rows

    def _background_refresh(self) -> None:
        try:
            self.refresh()
        except Exception as error:
            self.html.value = f"<p>refresh failed: {html.escape(repr(error))}</p>"

    def _on_display(self) -> None:
        if self._updater is not None:
            self._updater.start()

    def stop(self) -> None:
        """Stop the periodic refresh and bring the saved frame up to date."""
        if self._updater is not None:
            self._updater.stop()
        self.refresh()
        self.show_final_frame()

    def _repr_html_(self) -> str:
        if not self.rows:
            return "<p>no task family applied yet</p>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
        body = []
        for row in self.rows:
            style = ' style="color:#c00;font-weight:bold"' if row["flag"] else ""
            cells = "".join(f"<td>{html.escape(_format(row.get(c)))}</td>" for c in COLUMNS)
            body.append(f"<tr{style}>{cells}</tr>")
        flagged = sum(bool(r["flag"]) for r in self.rows)
        return (f"<p>{len(self.rows)} task families, {flagged} flagged</p>"
                f"<table><tr>{head}</tr>{''.join(body)}</table>")

    def __repr__(self) -> str:
        return text_table([{c: _format(r.get(c)) for c in COLUMNS} for r in self.rows], COLUMNS) if self.rows \
            else "FamilyMonitor(no task family applied yet)"


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
