"""``carlskit.devices()``: which JAX backend and devices each process of the session has."""

from __future__ import annotations

import html
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from distributed import Client

from carlskit._checks import instance
from carlskit.cluster._connect import usable_cores

_COLUMNS = ("process", "group", "host", "pid", "backend", "device_count", "device_kinds", "threads", "resources")


def local_devices() -> dict[str, Any]:
    """Backend and devices of the calling process; importing JAX here is what initialises it."""
    import jax

    devices = jax.devices()
    kinds = Counter(f"{device.platform}:{device.device_kind}" for device in devices)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "backend": jax.default_backend(),
        "device_count": len(devices),
        "device_kinds": ", ".join(f"{count} x {kind}" for kind, count in sorted(kinds.items())),
    }


def worker_devices(dask_worker: Any) -> dict[str, Any]:
    """:func:`local_devices` of a worker plus what configured it (group, threads, resources)."""
    config = getattr(dask_worker, "carlskit_config", None) or {}
    return {**local_devices(), "group": config.get("group"),
            "threads": dask_worker.state.nthreads,
            "resources": dict(dask_worker.state.total_resources)}


@dataclass(frozen=True)
class DeviceReport:
    """One row per process: the notebook (``"client"``) and each Dask worker, by address."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, process: str) -> dict[str, Any]:
        for row in self.rows:
            if row["process"] == process:
                return row
        raise KeyError(process)

    @property
    def workers(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if row["process"] != "client"]

    def group(self, name: str) -> list[dict[str, Any]]:
        """The rows of the workers of group ``name`` (``connect(worker_groups=...)``)."""
        return [row for row in self.workers if row.get("group") == name]

    def __repr__(self) -> str:
        cells = [list(_COLUMNS)] + [[str(row[name]) for name in _COLUMNS] for row in self.rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
        lines = ["  ".join(value.ljust(width) for value, width in zip(line, widths)) for line in cells]
        return "\n".join(line.rstrip() for line in lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{name}</th>" for name in _COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(row[name]))}</td>" for name in _COLUMNS) + "</tr>"
            for row in self.rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def devices(client: Client | None = None) -> DeviceReport:
    """JAX backend and devices of this process and, given a client, of every worker.

    Runs one small function per worker (``Client.run``), which imports JAX there; workers were
    configured beforehand by :func:`carlskit.connect`'s worker plugin.
    """
    if client is not None:
        instance(client, "client", Client, "a distributed.Client or None")
    rows = [{"process": "client", "group": None, **local_devices(), "threads": usable_cores(),
             "resources": {}}]
    if client is not None:
        for address, info in sorted(client.run(worker_devices).items()):
            rows.append({"process": address, **info})
    return DeviceReport(rows)

