"""Dask clusters for carlskit: connect from a notebook, configure workers for JAX, list devices."""

from carlskit.cluster._connect import connect
from carlskit.cluster._devices import DeviceReport, devices
from carlskit.cluster._environment import JaxWorkerSetup, worker_environment
from carlskit.cluster._supervised import RestartPolicy

__all__ = ["connect", "devices", "DeviceReport", "JaxWorkerSetup", "worker_environment", "RestartPolicy"]
