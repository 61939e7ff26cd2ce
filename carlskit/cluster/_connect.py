"""``carlskit.connect()``: one Dask client for the whole session, embedded or remote."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import dask
import distributed
from dask.typing import no_default
from distributed import Client, LocalCluster, Nanny
from distributed.core import Status

from carlskit._checks import instance, integer, positive_int
from carlskit.cluster._environment import (
    GROUP_VARIABLE,
    HOST_DEVICES_VARIABLE,
    PLATFORM_VARIABLE,
    JaxWorkerSetup,
    check_platform,
    merge_xla_flags,
    worker_environment,
)
from carlskit.cluster._placement import check_resources

DEFAULT_TIMEOUT_SECONDS = 30.0


def usable_cores() -> int:
    """Cores this process may run on (CPU affinity, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def _default_client() -> Client | None:
    try:
        client = distributed.default_client()
    except ValueError:
        return None
    return client if client.status == "running" else None


def _timeout_seconds(timeout: float | str) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, str, datetime.timedelta)):
        raise TypeError(f"timeout must be seconds (a number), a duration string like '30s' or a timedelta, "
                        f"got {type(timeout).__name__}")
    try:
        seconds = dask.utils.parse_timedelta(timeout, default="seconds")
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"timeout must be seconds or a duration like '30s', got {timeout!r}") from error
    if seconds is None or seconds <= 0:
        raise ValueError(f"timeout must be a positive duration, got {timeout!r}")
    return float(seconds)


@dataclasses.dataclass(frozen=True)
class WorkerGroup:
    """One named group of workers in an embedded cluster (``connect(worker_groups=...)``).

    Args:
      n_workers, threads_per_worker, memory_limit: as for ``distributed.LocalCluster``, per group.
      platform: ``JAX_PLATFORMS`` of these workers (``None``: an accelerator group keeps its
        accelerator, any other group gets ``cpu`` on a machine without one).
      resources: Dask worker resources the group offers (``{"GPU": 1}``, ``{"maker": 1}``); services
        placed with ``resources=`` run only on workers offering them.
      devices: simulated host devices per worker (``--xla_force_host_platform_device_count``), to
        test multi-device code on a CPU.
    """

    n_workers: int = 1
    threads_per_worker: int = 1
    platform: str | None = None
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    devices: int | None = None
    memory_limit: str | int | float | None = "auto"

    def __post_init__(self) -> None:
        integer(self.n_workers, "n_workers", minimum=0)
        positive_int(self.threads_per_worker, "threads_per_worker")
        check_platform(self.platform)
        resources = check_resources(self.resources)
        if self.devices is not None:
            positive_int(self.devices, "devices")
        object.__setattr__(self, "resources", resources)

    @classmethod
    def from_spec(cls, name: str, spec: WorkerGroup | Mapping[str, Any]) -> WorkerGroup:
        if isinstance(spec, WorkerGroup):
            return spec
        instance(spec, f"worker_groups[{name!r}]", Mapping, "a dict or WorkerGroup")
        unknown = sorted(set(spec) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"worker_groups[{name!r}] has unknown keys {unknown}; "
                             f"known: {[field.name for field in dataclasses.fields(cls)]}")
        try:
            return cls(**spec)
        except (TypeError, ValueError) as error:
            raise type(error)(f"worker_groups[{name!r}]: {error}") from error


def connect(
    address: str | None = None,
    *,
    scheduler_file: str | os.PathLike | None = None,
    n_workers: int | None = None,
    threads_per_worker: int = 1,
    processes: bool = True,
    memory_limit: str | int | float | None = "auto",
    dashboard_address: str | None = "127.0.0.1:0",
    security: distributed.Security | bool | None = None,
    timeout: float | str = DEFAULT_TIMEOUT_SECONDS,
    platform: str | None = None,
    worker_groups: Mapping[str, WorkerGroup | Mapping[str, Any]] | None = None,
) -> Client:
    """Return a Dask client, starting an embedded ``LocalCluster`` only when nothing else exists.

    Resolution order with no ``address`` and no ``scheduler_file``:
    the existing default client, then ``DASK_SCHEDULER_ADDRESS`` (also read from Dask's config
    ``scheduler-address``), then a new ``LocalCluster`` of worker processes bound to 127.0.0.1 with
    ``n_workers`` (default: the usable cores) x ``threads_per_worker``. Calling ``connect()`` again
    returns the same client, so a notebook never starts a second cluster.

    Every worker is configured for JAX before JAX is imported there, from its own facts (see
    :mod:`carlskit.cluster._environment`): thread limits equal to its thread count, no GPU memory
    preallocation, and ``JAX_PLATFORMS``: the platform it was started with, none for a worker
    offering an accelerator resource (JAX uses the accelerator), else ``platform`` or ``cpu``.

    Args:
      address: a scheduler address such as ``"tcp://10.0.0.5:8786"`` or ``"tls://..."``.
      scheduler_file: a JSON file written by ``dask scheduler --scheduler-file``.
      n_workers, threads_per_worker, processes, memory_limit, dashboard_address: as for
        ``distributed.LocalCluster``; used only when an embedded cluster is started.
      security: a ``distributed.Security`` (TLS credentials), passed to the client and, for an
        embedded cluster, to the scheduler and workers too.
      timeout: seconds (or a Dask duration string) to wait for the scheduler; an unreachable
        scheduler raises ``ConnectionError`` after this, never hangs.
      platform: JAX platform for workers that do not have one of their own (``"cpu"``, ``"gpu"``,
        ``"tpu"``); ``None`` chooses.
      worker_groups: build an embedded *heterogeneous* cluster (on Dask's ``SpecCluster``) of named
        groups, each a :class:`WorkerGroup` or a dict of its fields, e.g. ``{"trainer":
        {"n_workers": 1, "devices": 4, "resources": {"accelerator": 1}}, "makers": {"n_workers": 2,
        "resources": {"maker": 1}}}``. Replaces ``n_workers``/``threads_per_worker``/``memory_limit``;
        worker ``i`` of group ``g`` is named ``"g-i"``.

    Returns:
      A running ``distributed.Client``, set as the default client.
    """
    if address is not None and scheduler_file is not None:
        raise ValueError("pass either address or scheduler_file, not both")
    if address is not None:
        instance(address, "address", str, "a str like 'tcp://host:8786'")
    if n_workers is not None:
        integer(n_workers, "n_workers", minimum=0)
    timeout_seconds = _timeout_seconds(timeout)
    try:
        environment = worker_environment(threads_per_worker, platform)
    except (TypeError, ValueError) as error:
        raise type(error)(str(error).replace("threads ", "threads_per_worker ", 1)) from error
    groups = None
    if worker_groups is not None:
        if address is not None or scheduler_file is not None or n_workers is not None or not processes:
            raise ValueError("worker_groups builds an embedded cluster of worker processes: pass it without "
                             "address, scheduler_file, n_workers or processes=False")
        groups = _worker_groups(worker_groups)
    if address is None and scheduler_file is None:
        existing = _default_client()
        if existing is not None:
            if groups is not None and _groups_of(existing) != set(groups):
                raise ValueError(f"a client is already running (groups {sorted(_groups_of(existing))}); close it "
                                 f"before starting a cluster with worker groups {sorted(groups)}")
            return existing
        address = os.environ.get("DASK_SCHEDULER_ADDRESS") or dask.config.get(
            "scheduler-address", None
        )

    client = _open_client(address, scheduler_file, groups, n_workers=n_workers, threads_per_worker=threads_per_worker,
                          processes=processes, memory_limit=memory_limit, dashboard_address=dashboard_address,
                          security=security, timeout_seconds=timeout_seconds, platform=platform,
                          environment=environment)
    if scheduler_file is None and address is None and not processes:
        return client  # workers are threads of this process: its environment is the user's own
    try:
        client.register_plugin(JaxWorkerSetup(platform), name=JaxWorkerSetup.name)
    except BaseException:
        client.close()
        raise
    return client


def _worker_groups(worker_groups: Any) -> dict[str, WorkerGroup]:
    """``connect(worker_groups=...)`` checked: group name -> :class:`WorkerGroup`."""
    instance(worker_groups, "worker_groups", Mapping, "a non-empty dict of group name -> spec")
    if not worker_groups:
        raise ValueError(f"worker_groups must be a non-empty dict of group name -> spec, got {worker_groups!r}")
    groups = {}
    for name, spec in worker_groups.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"worker_groups keys must be non-empty str group names, got {name!r}")
        groups[name] = WorkerGroup.from_spec(name, spec)
    return groups


def _open_client(address: str | None, scheduler_file: Any, groups: dict[str, WorkerGroup] | None, *,
                 n_workers: int | None, threads_per_worker: int, processes: bool, memory_limit: Any,
                 dashboard_address: str | None, security: Any, timeout_seconds: float, platform: str | None,
                 environment: dict[str, str]) -> Client:
    """A client of the scheduler in ``scheduler_file``, at ``address``, or of a new embedded cluster
    (of worker ``groups`` if given)."""
    if scheduler_file is not None:
        if not Path(scheduler_file).exists():
            raise FileNotFoundError(f"scheduler_file {str(scheduler_file)!r} does not exist")
        client = _connect_remote(
            dict(scheduler_file=str(scheduler_file)), security, timeout_seconds, where=scheduler_file
        )
    elif address is not None:
        if address.startswith("tls://") and not isinstance(security, distributed.Security):
            raise ValueError(
                f"address {address!r} uses TLS: pass security=distributed.Security(...) credentials"
            )
        _check_speaks_dask(address, timeout_seconds)
        client = _connect_remote(dict(address=address), security, timeout_seconds, where=address)
    elif groups is not None:
        client = _start_group_cluster(groups, dashboard_address=dashboard_address, security=security,
                                      timeout=timeout_seconds, platform=platform)
    else:
        client = _start_local_cluster(
            n_workers=usable_cores() if n_workers is None else n_workers,
            threads_per_worker=threads_per_worker,
            processes=processes,
            memory_limit=memory_limit,
            dashboard_address=dashboard_address,
            security=security,
            timeout=timeout_seconds,
            environment=environment,
        )
    return client


# A Dask server's first frame (its handshake) is a few dozen bytes; a length past this is not Dask.
_HANDSHAKE_LIMIT = 64 << 20


def _check_speaks_dask(address: str, timeout_seconds: float) -> None:
    """Raise ``ConnectionError`` unless the ``tcp://`` server at ``address`` greets like Dask.

    A Dask server writes its handshake as soon as it accepts a connection: an 8-byte frame length
    (``struct`` format ``"Q"``, Dask's TCP framing) and a small message. ``distributed.Client``
    would wait forever on a server that sends nothing (the dashboard's HTTP port, say) and read
    any other bytes as a huge frame length. Other schemes (``tls://``, ``inproc://``) are left to Dask.
    """
    scheme, location = distributed.comm.parse_address(address)
    if scheme != "tcp":
        return
    host, port = distributed.comm.parse_host_port(location)
    deadline = time.monotonic() + timeout_seconds
    header = b""
    try:
        probe = socket.create_connection((host, port), timeout=timeout_seconds)
    except OSError as error:  # refused, unreachable, timed out
        raise ConnectionError(f"could not connect to the Dask scheduler at {address!r} within "
                              f"{timeout_seconds:g} s: {error}") from error
    with probe:
        try:
            while len(header) < 8:
                probe.settimeout(max(deadline - time.monotonic(), 1e-3))
                chunk = probe.recv(8 - len(header))
                if not chunk:
                    break
                header += chunk
        except TimeoutError as error:
            raise ConnectionError(
                f"the server at {address!r} accepted a connection but sent no Dask handshake within "
                f"{timeout_seconds:g} s: not a Dask scheduler (a dashboard or other HTTP port?)") from error
        except OSError as error:
            raise ConnectionError(f"the connection to {address!r} failed before a Dask handshake: "
                                  f"{error}") from error
    if len(header) < 8:
        raise ConnectionError(f"the server at {address!r} closed the connection without a Dask "
                              f"handshake: not a Dask scheduler")
    (length,) = struct.unpack("Q", header)
    if not 0 < length <= _HANDSHAKE_LIMIT:
        raise ConnectionError(f"the server at {address!r} does not speak Dask's protocol (its first "
                              f"frame would be {length} bytes): not a Dask scheduler")


def _connect_remote(
    target: dict[str, Any], security: Any, timeout_seconds: float, where: Any
) -> Client:
    try:
        return Client(**target, security=security, timeout=timeout_seconds, set_as_default=True)
    except (OSError, TimeoutError) as error:
        raise ConnectionError(
            f"could not connect to the Dask scheduler at {str(where)!r} within "
            f"{timeout_seconds:g} s: {error}"
        ) from error


def _groups_of(client: Client) -> set[str]:
    cluster = getattr(client, "cluster", None)
    return set(getattr(cluster, "carlskit_groups", {}) or {})


def _split_environment(environment: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(thread limits, JAX variables): the first must be set before spawning, the second need not."""
    threads = {name: value for name, value in environment.items() if name.endswith("_NUM_THREADS")}
    jax_environ = {name: value for name, value in environment.items() if name not in threads}
    if "XLA_FLAGS" in jax_environ:
        jax_environ["XLA_FLAGS"] = merge_xla_flags(os.environ.get("XLA_FLAGS", ""), jax_environ["XLA_FLAGS"])
    return threads, jax_environ


@contextlib.contextmanager
def _pre_spawn_environment(thread_limits: dict[str, str]) -> Iterator[None]:
    """Thread limits in Dask's pre-spawn environment while workers are started, ours restored after.

    They must be in place before a worker interpreter loads numpy/BLAS. The Nanny writes them into
    *this* process's ``os.environ`` while spawning; restoring ours keeps the notebook on all its cores.
    """
    spawn_environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    spawn_environ.update(thread_limits)
    saved = {name: os.environ.get(name) for name in spawn_environ}
    try:
        with dask.config.set({"distributed.nanny.pre-spawn-environ": spawn_environ}), _main_not_reimported():
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Workers spawned here do not re-import the program's ``__main__``.

    multiprocessing's spawn makes each new process import the parent's main module (by name for
    ``python -m X``, by path for a script) before the worker runs, so X's top-level imports, JAX's
    among them, came before carlskit configured the worker: ``python -m carlskit.paradigms.graph_reg
    --workers 2`` warned "JAX was imported on worker ... before carlskit configured it" about its own
    cluster (issue 44). A notebook's ``__main__`` has neither name nor file, so its workers import
    nothing; while the workers spawn, the program's looks the same. (Tasks defined in ``__main__``
    travel by value with cloudpickle and need no import there.)
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__spec__", "__file__") if name in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)


def _start_group_cluster(groups: dict[str, WorkerGroup], *, dashboard_address: str | None, security: Any,
                         timeout: float, platform: str | None) -> Client:
    """A ``SpecCluster`` with one ``Nanny`` spec per worker of each group (its own threads, resources,
    platform and simulated devices); the worker plugin configures each from these facts."""
    from distributed import Nanny, Scheduler, SpecCluster

    protocol = "tls://" if getattr(security, "require_encryption", False) else "tcp://"
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": dashboard_address,
                                               "protocol": protocol, "security": security}}
    workers = {}
    for group_name, group in groups.items():
        environment = worker_environment(group.threads_per_worker, group.platform or platform, group.devices)
        _, jax_environ = _split_environment(environment)
        jax_environ[GROUP_VARIABLE] = group_name
        # The notebook's own JAX_PLATFORMS must not leak into a group (an accelerator group would be
        # forced to it): "" reads as "none given" and lets JAX choose.
        jax_environ.setdefault("JAX_PLATFORMS", "")
        if group.platform is not None:
            jax_environ[PLATFORM_VARIABLE] = group.platform
        if group.devices is not None:
            jax_environ[HOST_DEVICES_VARIABLE] = str(group.devices)
        for index in range(group.n_workers):
            name = f"{group_name}-{index}"
            workers[name] = {"cls": Nanny, "options": {
                "nthreads": group.threads_per_worker, "resources": dict(group.resources) or None,
                "memory_limit": group.memory_limit, "host": "127.0.0.1", "protocol": protocol,
                "security": security, "env": jax_environ, "name": name, "silence_logs": logging.WARNING}}
    # Groups may differ in threads; the spawn-time limit is the smallest (never oversubscribed), and
    # the worker plugin then sets each worker's own BLAS limit (threadpoolctl) before any task runs.
    fewest = min(group.threads_per_worker for group in groups.values())
    thread_limits, _ = _split_environment(worker_environment(fewest))
    with _pre_spawn_environment(thread_limits):
        cluster = SpecCluster(workers=workers, scheduler=scheduler, security=security,
                              silence_logs=logging.WARNING, name="carlskit-groups")
    cluster.carlskit_groups = groups
    return _embedded_client(cluster, timeout)


def _start_local_cluster(*, environment: dict[str, str], timeout: float, **cluster_kwargs) -> Client:
    # JAX's variables are only read when JAX is imported, so they go to the worker alone through
    # the Nanny's ``env``; thread limits must be set before spawning.
    thread_limits, jax_environ = _split_environment(environment)
    if getattr(cluster_kwargs["security"], "require_encryption", False):
        cluster_kwargs["protocol"] = "tls://"
    if cluster_kwargs["processes"]:
        cluster_kwargs["env"] = jax_environ  # threads in this process share its environment
    with _pre_spawn_environment(thread_limits):
        # Worker processes listen on loopback only; threads in this process talk in-process.
        host = {"host": "127.0.0.1"} if cluster_kwargs["processes"] or "protocol" in cluster_kwargs else {}
        cluster = LocalCluster(timeout=timeout, **host, **cluster_kwargs)
    return _embedded_client(cluster, timeout)


def _embedded_client(cluster: Any, timeout: float) -> Client:
    try:
        # Workers of an embedded cluster are reachable from here: actor calls (bank shards) go
        # straight to them instead of through the scheduler, one network hop less per call.
        return EmbeddedClient(
            cluster, security=cluster.security, timeout=timeout, set_as_default=True,
            direct_to_workers=True,
        )
    except BaseException:
        cluster.close()
        raise


class EmbeddedClient(Client):
    """The client of a ``LocalCluster`` that :func:`connect` started: closing it closes the cluster.

    (A plain ``Client(cluster)`` leaves the cluster running; a notebook user expects
    ``client.close()`` to stop the worker processes that ``connect()`` started.)
    """

    def close(self, timeout=no_default):
        if self.cluster is not None and not self.asynchronous and self.status == "running":
            # A worker's heartbeat in flight while the cluster retires it fails with CommClosedError,
            # which the worker logs as a 25-line ERROR with a traceback (1 close in 6 on a quiet
            # 2-core machine, 2 in 3 with a worker heart-beating nonstop; issue 44): the notebook's
            # last cell looked broken. Stop the heartbeats and drop exactly those shutdown messages.
            # (A lost or hung worker must not hold the close up: 5 s at most, errors ignored.)
            with contextlib.suppress(Exception):
                self.sync(self._run, _quiet_for_shutdown, on_error="ignore", callback_timeout=5)
        result = super().close(timeout=timeout)
        # (Client.__del__ closes again at interpreter exit: a closed cluster is left alone.)
        if self.cluster is not None and not self.asynchronous and self.cluster.status != Status.closed:
            _close_workers_patiently(self.cluster)
            self.cluster.close()
            _WORKER_LOGGER.removeFilter(_SHUTDOWN_NOISE)  # workers that were threads of this process
        return result


class _ShutdownNoise(logging.Filter):
    """Drops what a worker logs when its heartbeat races the closing scheduler (and nothing else)."""

    MESSAGES = ("Failed to communicate with scheduler during heartbeat",
                "Scheduler was unaware of this worker; shutting down")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.MESSAGES)


_WORKER_LOGGER = logging.getLogger("distributed.worker")
_SHUTDOWN_NOISE = _ShutdownNoise()


# Seconds a worker process gets to exit when its embedded cluster closes, before its nanny kills it.
# Dask's own close gives 4 s (0.8 x 5) and then logs "Worker process still alive after 4.0 seconds,
# killing" on the notebook's stderr: notebook 09's last close did so at load 6-14 (issue 44).
WORKER_EXIT_SECONDS = 20.0


def _close_workers_patiently(cluster: Any) -> None:
    """Close the cluster's nannies (its worker processes) with :data:`WORKER_EXIT_SECONDS` each, all
    at once; the cluster's own close then finds them closed."""
    nannies = [worker for worker in dict(getattr(cluster, "workers", {}) or {}).values() if isinstance(worker, Nanny)]
    if not nannies:
        return

    async def close_all() -> None:
        await asyncio.gather(*(nanny.close(timeout=WORKER_EXIT_SECONDS) for nanny in nannies), return_exceptions=True)

    with contextlib.suppress(Exception):  # the cluster's own close still runs, with Dask's timeouts
        cluster.sync(close_all)


def _quiet_for_shutdown(dask_worker: Any) -> None:
    """Run on every worker just before an embedded cluster closes: no new heartbeat starts, and
    one already in flight fails without logging (the worker is about to be retired anyway)."""
    callback = dask_worker.periodic_callbacks.get("heartbeat")
    if callback is not None:
        callback.stop()
    _WORKER_LOGGER.addFilter(_SHUTDOWN_NOISE)  # a no-op when already added
