"""``EvalCurves``: learning curves of evaluation tasks per meta-training checkpoint."""

from __future__ import annotations

import html
import math
import threading
from collections.abc import Mapping
from typing import Any

import ipywidgets
import numpy as np
import pandas as pd

from carlskit.widgets._display import WidgetDisplay, html_table, png_img_tag, render_png, text_table

COLUMNS = ["checkpoint", "task_set", "split", "step", "value"]
SPLIT_COLORS = {"train": "tab:blue", "valid": "tab:orange", "test": "tab:green"}


def curves_frame(data: Any) -> pd.DataFrame:
    """Normalise evaluation curves to one long DataFrame with columns
    ``checkpoint, task_set, split, step, value``.

    Accepted inputs:
      * that DataFrame itself (``step`` optional: 0, 1, 2, ... within each curve when absent);
      * a nested dict ``{checkpoint: {task_set: {split: curve}}}`` where ``split`` is e.g.
        ``"train"``, ``"valid"``, ``"test"`` and ``curve`` is a sequence of values (steps 0, 1, ...)
        or a pair ``(steps, values)`` of equal-length sequences.
    """
    if isinstance(data, pd.DataFrame):
        missing = {"checkpoint", "task_set", "split", "value"} - set(data.columns)
        if missing:
            raise ValueError(f"data DataFrame lacks columns {sorted(missing)}; expected {COLUMNS}")
        frame = data.copy()
        if "step" not in frame:
            frame["step"] = frame.groupby(["checkpoint", "task_set", "split"]).cumcount()
        frame["value"] = _numeric(frame["value"], "data['value']", np.float64)
        frame["step"] = _numeric(frame["step"], "data['step']", None)
        return frame[COLUMNS].reset_index(drop=True)
    if not isinstance(data, Mapping):
        raise TypeError(
            "data must be a DataFrame or a dict {checkpoint: {task_set: {split: values}}}, "
            f"got {type(data).__name__}")
    parts = []
    for checkpoint, task_sets in data.items():
        if not isinstance(task_sets, Mapping):
            raise TypeError(f"data[{checkpoint!r}] must be a dict {{task_set: {{split: values}}}}")
        for task_set, splits in task_sets.items():
            if not isinstance(splits, Mapping):
                raise TypeError(f"data[{checkpoint!r}][{task_set!r}] must be a dict {{split: values}}")
            for split, curve in splits.items():
                steps, values = _curve_arrays(curve, f"data[{checkpoint!r}][{task_set!r}][{split!r}]")
                parts.append(pd.DataFrame({"checkpoint": [checkpoint] * len(values),
                                           "task_set": task_set, "split": split,
                                           "step": steps, "value": values}))
    if not parts:
        return pd.DataFrame({name: [] for name in COLUMNS})
    return pd.concat(parts, ignore_index=True)[COLUMNS]


def _curve_arrays(curve: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(curve, tuple) and len(curve) == 2:
        steps, values = (np.asarray(part) for part in curve)
    else:
        values = np.asarray(curve)
        steps = np.arange(values.shape[0] if values.ndim else 0)
    if values.ndim != 1 or steps.shape != values.shape:
        raise ValueError(f"{where} must be a 1-D sequence of values or (steps, values) of equal length")
    return _numeric(steps, f"{where} steps", None), _numeric(values, f"{where} values", np.float64)


def _numeric(column: Any, where: str, dtype: type | None) -> np.ndarray:
    """``column`` checked to hold numbers (bool, int or float; never strings or objects) and
    converted to ``dtype`` (None keeps its own), or a ValueError naming where it came from."""
    array = np.asarray(column)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{where} must be numbers, got dtype {array.dtype} ({array[:3].tolist()!r}...)")
    return array if dtype is None else array.astype(dtype)


class EvalCurves(WidgetDisplay):
    """Learning curves per checkpoint and task set, with a checkpoint selector.

    One panel per task set; one line per split (train / valid / test). New checkpoints stream in
    with :meth:`add` (the evaluation chief calls it as results arrive); the selector follows the
    newest checkpoint unless the user picked another.

    Args:
      data: see :func:`curves_frame` (a DataFrame or ``{checkpoint: {task_set: {split: curve}}}``).
      checkpoint: the checkpoint shown first; default the last one.
      x_label, y_label: the axes' labels (the learned-optimizer evaluation's are the defaults: inner
        training steps and the task's loss); give what your curves' steps and values are.
    """

    def __init__(self, data: Any = None, *, checkpoint: Any = None, width_inches: float = 8.0,
                 panel_height_inches: float = 2.6, x_label: str = "inner step", y_label: str = "loss"):
        for name, label in (("x_label", x_label), ("y_label", y_label)):
            if not isinstance(label, str):
                raise TypeError(f"{name} must be a str, got {type(label).__name__}")
        self.x_label, self.y_label = x_label, y_label
        self.frame = curves_frame({} if data is None else data)
        self.width_inches, self.panel_height_inches = width_inches, panel_height_inches
        self._lock = threading.Lock()
        self._follow_latest = checkpoint is None
        self.image = ipywidgets.Image(format="png", layout=ipywidgets.Layout(width="100%", max_width="900px"))
        self.selector = ipywidgets.Dropdown(description="checkpoint", options=self.checkpoints)
        self.table = ipywidgets.HTML()
        self.widget = ipywidgets.VBox([self.selector, self.image, self.table])
        if checkpoint is not None:
            self._check_checkpoint(checkpoint)
            self.selector.value = checkpoint
        elif self.checkpoints:
            self.selector.value = self.checkpoints[-1]
        self.selector.observe(self._on_select, names="value")
        self._redraw()

    @property
    def png(self) -> bytes:
        """The PNG currently shown."""
        return bytes(self.image.value)

    @property
    def checkpoints(self) -> list:
        return list(dict.fromkeys(self.frame["checkpoint"].tolist()))

    @property
    def checkpoint(self) -> Any:
        return self.selector.value

    def _check_checkpoint(self, checkpoint: Any) -> None:
        if checkpoint not in self.checkpoints:
            raise ValueError(f"checkpoint {checkpoint!r} not in data; have {self.checkpoints}")

    def select(self, checkpoint: Any) -> None:
        """Show ``checkpoint`` (stops following the newest one)."""
        self._check_checkpoint(checkpoint)
        self._follow_latest = checkpoint == self.checkpoints[-1]
        self.selector.value = checkpoint

    def _on_select(self, change) -> None:
        if change["new"] is not None:
            self._follow_latest = change["new"] == self.checkpoints[-1]
            self._redraw()

    def add(self, data: Any) -> None:
        """Add curves (same structures as the constructor); a checkpoint/task set/split already
        present is replaced."""
        new = curves_frame(data)
        with self._lock:
            keys = ["checkpoint", "task_set", "split"]
            replaced = self.frame.set_index(keys).index.isin(new.set_index(keys).index)
            self.frame = pd.concat([self.frame[~replaced], new], ignore_index=True)
            options = self.checkpoints
        current = self.selector.value
        self.selector.unobserve(self._on_select, names="value")
        try:
            self.selector.options = options
            self.selector.value = options[-1] if (self._follow_latest or current is None) else current
        finally:
            self.selector.observe(self._on_select, names="value")
        self._redraw()

    def final_values(self, checkpoint: Any = None) -> pd.DataFrame:
        """Last value of every curve of a checkpoint (default the selected one)."""
        if checkpoint is None:
            checkpoint = self.selector.value
        else:
            self._check_checkpoint(checkpoint)
        rows = self.frame[self.frame["checkpoint"] == checkpoint]
        last = rows.sort_values("step").groupby(["task_set", "split"], sort=True).tail(1)
        return last.pivot(index="task_set", columns="split", values="value")

    def render(self, checkpoint: Any = None) -> bytes:
        """PNG of one checkpoint's curves (default the selected one)."""
        if checkpoint is None:
            checkpoint = self.selector.value
        else:
            self._check_checkpoint(checkpoint)
        with self._lock:
            rows = self.frame[self.frame["checkpoint"] == checkpoint]
        task_sets = list(dict.fromkeys(rows["task_set"].tolist()))
        columns = 1 if len(task_sets) <= 1 else 2
        height = self.panel_height_inches * max(1, math.ceil(len(task_sets) / columns))

        def draw(figure):
            if not task_sets:
                axes = figure.add_subplot(1, 1, 1)
                axes.text(0.5, 0.5, "no evaluation curves yet", ha="center", va="center")
                axes.set_axis_off()
                return
            for index, task_set in enumerate(task_sets):
                axes = figure.add_subplot(math.ceil(len(task_sets) / columns), columns, index + 1)
                for split, curve in rows[rows["task_set"] == task_set].groupby("split", sort=False):
                    curve = curve.sort_values("step")
                    axes.plot(curve["step"], curve["value"], label=str(split),
                              color=SPLIT_COLORS.get(str(split)))
                axes.set_title(f"{task_set} @ {checkpoint}", fontsize=10)
                axes.set_xlabel(self.x_label, fontsize=8)
                axes.set_ylabel(self.y_label, fontsize=8)
                axes.tick_params(labelsize=8)
                axes.grid(True, alpha=0.3)
                axes.legend(fontsize=8)

        return render_png(draw, self.width_inches, height)

    def _redraw(self) -> None:
        self.image.value = self.render()
        self.table.value = self._final_values_html()

    def _final_values_html(self) -> str:
        if self.selector.value is None:
            return ""
        table = self.final_values().reset_index()
        return html_table(table.to_dict("records"))

    def _repr_html_(self) -> str:
        parts = [f"<b>EvalCurves</b>: {len(self.checkpoints)} checkpoints"]
        for checkpoint in self.checkpoints[-3:]:  # static fallback: the newest few
            table = self.final_values(checkpoint).reset_index().to_dict("records")
            parts.append(f"<h4>{html.escape(str(checkpoint))}</h4>"
                         f"{png_img_tag(self.render(checkpoint), str(checkpoint))}"
                         f"{html_table(table)}")
        return "<div>" + "".join(parts) + "</div>"

    def __repr__(self) -> str:
        lines = [f"EvalCurves({len(self.checkpoints)} checkpoints, selected={self.selector.value!r})"]
        if self.selector.value is not None:
            lines.append(text_table(self.final_values().reset_index().to_dict("records")))
        return "\n".join(lines)
