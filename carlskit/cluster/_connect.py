"""``carlskit.connect()``: one Dask client for the whole session, embedded or remote."""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import dask
import distributed
from dask.typing import no_default
from distributed import Client, LocalCluster

from carlskit.cluster._environment import JaxWorkerSetup, merge_xla_flags, worker_environment

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
    if isinstance(timeout, bool):
        raise ValueError(f"timeout must be a positive duration, got {timeout!r}")
    try:
        seconds = dask.utils.parse_timedelta(timeout, default="seconds")
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"timeout must be seconds or a duration like '30s', got {timeout!r}") from error
    if seconds is None or seconds <= 0:
        raise ValueError(f"timeout must be a positive duration, got {timeout!r}")
    return float(seconds)


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
) -> Client:
    """Return a Dask client, starting an embedded ``LocalCluster`` only when nothing else exists.

    Resolution order with no ``address`` and no ``scheduler_file``:
    the existing default client, then ``DASK_SCHEDULER_ADDRESS`` (also read from Dask's config
    ``scheduler-address``), then a new ``LocalCluster`` of worker processes bound to 127.0.0.1 with
    ``n_workers`` (default: the usable cores) x ``threads_per_worker``. Calling ``connect()`` again
    returns the same client, so a notebook never starts a second cluster.

    Every worker is configured for JAX before JAX is imported there (see
    :func:`carlskit.cluster.worker_environment`): thread limits equal to ``threads_per_worker``, no
    GPU memory preallocation, and ``JAX_PLATFORMS=platform`` when given.

    Args:
      address: a scheduler address such as ``"tcp://10.0.0.5:8786"`` or ``"tls://..."``.
      scheduler_file: a JSON file written by ``dask scheduler --scheduler-file``.
      n_workers, threads_per_worker, processes, memory_limit, dashboard_address: as for
        ``distributed.LocalCluster``; used only when an embedded cluster is started.
      security: a ``distributed.Security`` (TLS credentials), passed to the client and, for an
        embedded cluster, to the scheduler and workers too.
      timeout: seconds (or a Dask duration string) to wait for the scheduler; an unreachable
        scheduler raises ``ConnectionError`` after this, never hangs.
      platform: JAX platform for workers (``"cpu"``, ``"gpu"``, ``"tpu"``); ``None`` chooses.

    Returns:
      A running ``distributed.Client``, set as the default client.
    """
    if address is not None and scheduler_file is not None:
        raise ValueError("pass either address or scheduler_file, not both")
    if address is not None and not isinstance(address, str):
        raise TypeError(f"address must be a str like 'tcp://host:8786', got {type(address).__name__}")
    if n_workers is not None and (not isinstance(n_workers, int) or n_workers < 0):
        raise ValueError(f"n_workers must be a non-negative int, got {n_workers!r}")
    timeout_seconds = _timeout_seconds(timeout)
    try:
        environment = worker_environment(threads_per_worker, platform)
    except ValueError as error:
        raise ValueError(str(error).replace("threads ", "threads_per_worker ", 1)) from error

    if address is None and scheduler_file is None:
        existing = _default_client()
        if existing is not None:
            return existing
        address = os.environ.get("DASK_SCHEDULER_ADDRESS") or dask.config.get(
            "scheduler-address", None
        )

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
    if scheduler_file is None and address is None and not processes:
        return client  # workers are threads of this process: its environment is the user's own
    try:
        client.register_plugin(JaxWorkerSetup(environment), name=JaxWorkerSetup.name)
    except BaseException:
        client.close()
        raise
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


def _start_local_cluster(*, environment: dict[str, str], timeout: float, **cluster_kwargs) -> Client:
    # Thread limits must be in place before the worker interpreter loads numpy/BLAS, so they go into
    # Dask's pre-spawn environment. The Nanny writes that into *this* process's os.environ while
    # spawning; restore ours afterwards so the notebook keeps all its cores. JAX's variables are
    # only read when JAX is imported, so they go to the worker alone through the Nanny's ``env``.
    thread_names = {name for name in environment if name.endswith("_NUM_THREADS")}
    spawn_environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    spawn_environ.update({name: environment[name] for name in thread_names})
    jax_environ = {name: value for name, value in environment.items() if name not in thread_names}
    if "XLA_FLAGS" in jax_environ:
        jax_environ["XLA_FLAGS"] = merge_xla_flags(os.environ.get("XLA_FLAGS", ""), jax_environ["XLA_FLAGS"])
    if getattr(cluster_kwargs["security"], "require_encryption", False):
        cluster_kwargs["protocol"] = "tls://"
    if cluster_kwargs["processes"]:
        cluster_kwargs["env"] = jax_environ  # threads in this process share its environment
    saved = {name: os.environ.get(name) for name in spawn_environ}
    try:
        with dask.config.set({"distributed.nanny.pre-spawn-environ": spawn_environ}):
            # Worker processes listen on loopback only; threads in this process talk in-process.
            host = {"host": "127.0.0.1"} if cluster_kwargs["processes"] or "protocol" in cluster_kwargs else {}
            cluster = LocalCluster(timeout=timeout, **host, **cluster_kwargs)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
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
        result = super().close(timeout=timeout)
        if self.cluster is not None and not self.asynchronous:
            self.cluster.close()
        return result
