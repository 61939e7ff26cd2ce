"""``ClusterStatus``: workers, their devices, and whatever components report about themselves."""

from __future__ import annotations

import html
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets

from carlskit._checks import positive_float
from carlskit.widgets._display import PeriodicThread, WidgetDisplay, html_table, text_table

StatusSource = Any  # an object with ``status() -> dict`` or a callable returning a dict

WORKER_COLUMNS = ["worker", "name", "threads", "memory_used_mb", "memory_limit_mb", "executing", "in_memory"]
#: Report entries holding ``{service: {"state": ..., ...}}`` (supervision state): one table row per service.
SERVICE_KEYS = ("services", "health")


def _source_name(source: StatusSource) -> str:
    name = getattr(source, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(source, "__name__", None) or type(source).__name__


def _source_status(source: StatusSource) -> dict[str, Any]:
    report = source.status() if hasattr(source, "status") else source()
    if not isinstance(report, Mapping):
        raise TypeError(f"status of {_source_name(source)!r} must be a dict, got {type(report).__name__}")
    return dict(report)


def _service_row(name: str, item: Mapping[str, Any]) -> dict[str, Any]:
    """One table row per service: a :class:`carlskit.cluster.ServiceStatus` (every carlskit
    service's row), or a plain dict of the same columns from a source of one's own."""
    from carlskit.cluster import ServiceStatus  # the widgets import no cluster code until a board is drawn

    return item.row(name) if isinstance(item, ServiceStatus) else {"service": name, **dict(item)}


def _gave_up(table: list[dict]) -> list[str]:
    return [str(row.get("service")) for row in table if row.get("state") == "gave up"]


class ClusterStatus(WidgetDisplay):
    """A status board: the Dask workers, the JAX devices of each process, and one section per
    *source*.

    A source is any object with a ``status() -> dict`` method (or a plain callable returning a
    dict); knowledge banks report their tables and sizes, makers their throughput and lag, and
    future components plug in the same way. In a section, a value that is a list of dicts is shown
    as a table, anything else as a ``key: value`` row. A failing source shows its error instead of
    breaking the board. A ``"services"`` (or ``"health"``) entry mapping each service to its
    supervision state (a :class:`carlskit.cluster.ServiceStatus` each, or a dict of the same
    columns: ``{"learner": {"state": "restarting", ...}}``) is a table with one row per service,
    and services that ``"gave up"`` are named in red above it.

    Args:
      client: a ``distributed.Client`` or ``None`` (this process only).
      sources: objects with ``status()`` or callables returning dicts.
      every_seconds: refresh period once displayed; ``None`` refreshes only on :meth:`refresh` or
        the button.
      show_devices: run :func:`carlskit.devices` (imports JAX on each worker; done once, then on
        :meth:`refresh` with ``devices=True``).
    """

    def __init__(self, client: Any = None, *, sources: Sequence[StatusSource] = (),
                 every_seconds: float | None = None, show_devices: bool = True):
        if client is not None and not hasattr(client, "scheduler_info"):
            raise TypeError(f"client must be a distributed.Client or None, got {type(client).__name__}")
        sources = list(sources)
        for source in sources:
            if not (hasattr(source, "status") or callable(source)):
                raise TypeError(f"each source needs a status() method or must be callable; got {source!r}")
        if every_seconds is not None:
            positive_float(every_seconds, "every_seconds")
        self.client, self.sources, self.show_devices = client, sources, show_devices
        self.snapshot: dict[str, Any] = {}
        self._devices: list[dict[str, Any]] | None = None
        self.html = ipywidgets.HTML()
        self.refresh_button = ipywidgets.Button(description="refresh", icon="refresh")
        self.refresh_button.on_click(lambda _: self.refresh(devices=True))
        self.widget = ipywidgets.VBox([self.refresh_button, self.html])
        self._updater = (PeriodicThread(self._background_refresh, every_seconds, "carlskit-cluster-status")
                         if every_seconds is not None else None)
        self.refresh()

    def refresh(self, *, devices: bool = False) -> dict[str, Any]:
        """Collect a new snapshot (``workers``, ``devices``, ``sources``) and redraw."""
        snapshot: dict[str, Any] = {"time": time.strftime("%H:%M:%S"), "workers": self._workers()}
        if self.show_devices and (devices or self._devices is None):
            from carlskit.cluster import devices as collect_devices

            try:
                self._devices = list(collect_devices(self.client))
            except Exception as error:
                self._devices = [{"process": "?", "error": repr(error)}]
        snapshot["devices"] = self._devices or []
        reports = {}
        for source in self.sources:
            name = _source_name(source)
            if name in reports:  # two sources of one name (e.g. lambdas) both show
                name = f"{name} ({sum(key.startswith(name) for key in reports) + 1})"
            try:
                reports[name] = _source_status(source)
            except Exception as error:
                reports[name] = {"error": repr(error)}
        snapshot["sources"] = reports
        self.snapshot = snapshot
        self.html.value = self._repr_html_()
        return snapshot

    def _workers(self) -> list[dict[str, Any]]:
        if self.client is None:
            return []
        from carlskit.cluster import live_workers

        info = live_workers(self.client)
        rows = []
        for address, worker in sorted(info.items()):
            metrics = worker.get("metrics", {})
            rows.append({
                "worker": address, "name": worker.get("name", ""), "threads": worker.get("nthreads", 0),
                "memory_used_mb": round(metrics.get("memory", 0) / 2**20, 1),
                "memory_limit_mb": round((worker.get("memory_limit") or 0) / 2**20, 1),
                "executing": metrics.get("executing", 0), "in_memory": metrics.get("in_memory", 0),
            })
        return rows

    def _background_refresh(self) -> None:
        try:
            self.refresh()
        except Exception as error:
            self.html.value = f"<p>refresh failed: {html.escape(repr(error))}</p>"

    def start(self) -> None:
        """Start the periodic refresh now (it starts by itself when the board is displayed)."""
        if self._updater is not None:
            self._updater.start()

    def _on_display(self) -> None:
        self.start()

    def stop(self) -> None:
        """Stop refreshing; the displayed output's static frame becomes the last refresh."""
        if self._updater is not None:
            self._updater.stop()
        self.show_final_frame()

    def close(self) -> None:
        self.stop()
        self.widget.close()

    @staticmethod
    def _sections(report: Mapping[str, Any]) -> tuple[list[dict], dict[str, list[dict]]]:
        """Split a source's report into ``key: value`` rows and tables (lists of dicts)."""
        rows, tables = [], {}
        for key, value in report.items():
            if key in SERVICE_KEYS and isinstance(value, Mapping) and value and all(
                    isinstance(item, Mapping) for item in value.values()):
                tables[key] = [_service_row(name, item) for name, item in value.items()]
            elif isinstance(value, Sequence) and not isinstance(value, str) and value and all(
                    isinstance(item, Mapping) for item in value):
                tables[key] = [dict(item) for item in value]
            else:
                rows.append({"key": key, "value": value})
        return rows, tables

    def _repr_html_(self) -> str:
        snapshot = self.snapshot
        where = "no cluster (this process only)" if self.client is None else html.escape(
            str(getattr(getattr(self.client, "scheduler", None), "address", "")))
        parts = [f"<b>ClusterStatus</b> {where} at {snapshot.get('time', '')}"]
        if self.client is not None:
            parts.append(f"<h4>workers ({len(snapshot['workers'])})</h4>"
                         + html_table(snapshot["workers"], WORKER_COLUMNS))
        if self.show_devices:
            parts.append("<h4>devices</h4>" + html_table(snapshot["devices"]))
        for name, report in snapshot.get("sources", {}).items():
            rows, tables = self._sections(report)
            parts.append(f"<h4>{html.escape(name)}</h4>")
            if rows:
                parts.append(html_table(rows, ["key", "value"]))
            for key, table in tables.items():
                parts.append(f"<p><i>{html.escape(str(key))}</i></p>")
                if key in SERVICE_KEYS and _gave_up(table):
                    parts.append(f'<p style="color:#b00020"><b>gave up: '
                                 f'{html.escape(", ".join(_gave_up(table)))}</b></p>')
                parts.append(html_table(table))
        return "<div>" + "".join(parts) + "</div>"

    def __repr__(self) -> str:
        snapshot = self.snapshot
        lines = [f"ClusterStatus({len(snapshot.get('workers', []))} workers, "
                 f"{len(self.sources)} sources) at {snapshot.get('time', '')}"]
        if self.client is not None:
            lines += ["workers:", text_table(snapshot["workers"], WORKER_COLUMNS)]
        if self.show_devices:
            lines += ["devices:", text_table(snapshot["devices"])]
        for name, report in snapshot.get("sources", {}).items():
            rows, tables = self._sections(report)
            lines.append(f"{name}:")
            lines += [f"  {row['key']}: {row['value']}" for row in rows]
            for key, table in tables.items():
                lines.append(f"  {key}:")
                if key in SERVICE_KEYS and _gave_up(table):
                    lines.append(f"  GAVE UP: {', '.join(_gave_up(table))}")
                lines.append(text_table(table))
        return "\n".join(lines)

