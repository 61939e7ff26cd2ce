"""Dask clusters for carlskit: connect from a notebook, configure workers for JAX, list devices."""

from carlskit.cluster._connect import WorkerGroup, connect
from carlskit.cluster._devices import DeviceReport, devices
from carlskit.cluster._environment import JaxWorkerSetup, worker_environment
from carlskit.cluster._placement import NoWorkerError, Placement

__all__ = ["connect", "WorkerGroup", "devices", "DeviceReport", "JaxWorkerSetup", "worker_environment",
           "Placement", "NoWorkerError"]
