"""Dask clusters for carlskit: connect from a notebook (embedded, remote, or heterogeneous worker
groups), configure each worker for JAX from its own facts, list devices and live workers
(:func:`live_workers`), place services, and the service kit every long-running service is built from.

The service kit (one implementation of each, used by the bank, summaries, lopt, makers and
training):

- :class:`RestartPolicy` and :class:`Backoff`: exponential backoff with jitter, budgeted in seconds;
- :class:`ServiceState` and its :class:`ServiceStatus` row (running, restarting, waiting, gave up,
  stopped), read by :class:`carlskit.widgets.ClusterStatus` for every service, with the one
  :func:`give_up_message`;
- :class:`LongRunningTasks`: functions that loop until a :func:`stop_flag` is set, relaunched with
  backoff on the live workers of their :class:`Placement`;
- :class:`ActorHost`: one actor placed through :meth:`Placement.choose`, its loss told by state
  (:func:`actor_lost`, :func:`is_worker_loss`), rebuilt on a live worker;
- :func:`retry_on_worker_loss`: retry a call while it loses workers;
- :func:`run_spmd`: one JAX program over several workers (``jax.distributed``), every rank ended
  together on any failure, relaunched under a :class:`RestartPolicy` after a lost worker.
"""

from carlskit.cluster._connect import WorkerGroup, connect
from carlskit.cluster._devices import DeviceReport, devices, worker_devices
from carlskit.cluster._environment import JaxWorkerSetup, worker_environment
from carlskit.cluster._loss import actor_lost, is_worker_loss
from carlskit.cluster._placement import NoWorkerError, Placement, is_accelerator, live_workers
from carlskit.cluster._policy import Backoff, RestartPolicy, restart_policy
from carlskit.cluster._service import ActorHost, retry_on_worker_loss, worker_gone
from carlskit.cluster._spmd import report_progress, run_spmd, spmd_rank
from carlskit.cluster._status import ServiceState, ServiceStatus, give_up_message
from carlskit.cluster._supervised import (
    MAX_KEPT_ERRORS,
    LongRunningTasks,
    ThreadStopFlag,
    log_worker_event,
    secede_if_on_worker,
    stop_flag,
)

__all__ = ["connect", "WorkerGroup", "devices", "DeviceReport", "worker_devices", "JaxWorkerSetup",
           "worker_environment", "Placement", "NoWorkerError", "is_accelerator", "live_workers", "RestartPolicy",
           "restart_policy",
           "Backoff", "ServiceState", "ServiceStatus", "give_up_message", "ActorHost", "worker_gone",
           "retry_on_worker_loss", "LongRunningTasks", "stop_flag", "ThreadStopFlag", "secede_if_on_worker",
           "log_worker_event", "MAX_KEPT_ERRORS", "is_worker_loss", "actor_lost", "run_spmd",
           "report_progress", "spmd_rank"]
