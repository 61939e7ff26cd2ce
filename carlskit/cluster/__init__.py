"""Dask clusters for carlskit: connect from a notebook (embedded, remote, or heterogeneous worker
groups), configure each worker for JAX from its own facts, list devices, place services, and the
supervision layer every long-running service runs under (``RestartPolicy``)."""

from carlskit.cluster._connect import WorkerGroup, connect
from carlskit.cluster._devices import DeviceReport, devices
from carlskit.cluster._environment import JaxWorkerSetup, worker_environment
from carlskit.cluster._loss import actor_lost, is_worker_loss
from carlskit.cluster._placement import NoWorkerError, Placement
from carlskit.cluster._supervised import RestartPolicy

__all__ = ["connect", "WorkerGroup", "devices", "DeviceReport", "JaxWorkerSetup", "worker_environment",
           "Placement", "NoWorkerError", "RestartPolicy", "is_worker_loss", "actor_lost"]
