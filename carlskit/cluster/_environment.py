"""Process environment for JAX on Dask workers.

XLA, OpenMP (faiss), and BLAS read their settings from environment variables once, when they are
first imported. A worker must therefore be configured before any task imports JAX: for workers that
carlskit spawns (the embedded ``LocalCluster``) the variables go into
``distributed.nanny.pre-spawn-environ`` so the worker process starts with them; for workers of any
other deployment the :class:`JaxWorkerSetup` plugin sets them when it is registered, which is before
the first carlskit task runs there.

Each worker is configured from its *own* facts (:func:`worker_facts`), not the client's arguments:
its thread count, its Dask ``resources``, and a platform or simulated device count it was started
with (``CARLSKIT_PLATFORM`` / ``JAX_PLATFORMS``, ``CARLSKIT_HOST_DEVICES``). A worker that offers an
accelerator resource (``GPU``, ``TPU``, ``accelerator``: any case) or was started with a platform
keeps it; any other worker gets the client's ``platform`` if one was given, else ``cpu`` when the
machine shows no accelerator device files (CARLS section 3: makers and bank shards run on CPU
machines beside a trainer on an accelerator).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from carlskit._checks import positive_int

logger = logging.getLogger(__name__)

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_VALID_PLATFORMS = {"cpu", "gpu", "cuda", "rocm", "tpu"}
ACCELERATOR_RESOURCES = ("gpu", "tpu", "accelerator")
# Variables a worker may be started with (by `connect(worker_groups=...)` or a `dask worker` command).
PLATFORM_VARIABLE, HOST_DEVICES_VARIABLE, GROUP_VARIABLE = (
    "CARLSKIT_PLATFORM", "CARLSKIT_HOST_DEVICES", "CARLSKIT_WORKER_GROUP")


def check_platform(platform: str | None, name: str = "platform") -> str | None:
    """``platform`` as a comma list of JAX platforms, or ``None``; ValueError naming ``name``."""
    if platform is None:
        return None
    if not isinstance(platform, str):
        raise TypeError(f"{name} must be a str like 'cpu' or None, got {type(platform).__name__}")
    names = [part.strip() for part in platform.split(",") if part.strip()]
    unknown = [part for part in names if part not in _VALID_PLATFORMS]
    if not names or unknown:
        raise ValueError(f"{name} must name JAX platforms from {sorted(_VALID_PLATFORMS)}, got {platform!r}")
    return ",".join(names)


def worker_environment(threads: int = 1, platform: str | None = None,
                       host_devices: int | None = None) -> dict[str, str]:
    """Environment variables for a process that may import JAX and faiss.

    Args:
      threads: threads the process may use for XLA, OpenMP (faiss) and BLAS; usually Dask's
        ``threads_per_worker``, so that workers sharing a machine do not oversubscribe its cores.
      platform: value for ``JAX_PLATFORMS`` (``"cpu"``, ``"gpu"``, ``"tpu"``, or a comma list);
        ``None`` lets JAX pick the best backend present.
      host_devices: simulated CPU devices (``--xla_force_host_platform_device_count``), for
        testing multi-device code on a CPU.

    Returns:
      A dict of variable names to string values: thread limits, no GPU memory preallocation (so
      several processes can share one accelerator), and the platform when one is given.
    """
    positive_int(threads, "threads")
    environment = {name: str(threads) for name in _THREAD_VARIABLES}
    environment["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    flags = []
    if host_devices is not None:
        positive_int(host_devices, "host_devices")
        flags.append(f"--xla_force_host_platform_device_count={host_devices}")
    if threads == 1:
        flags.append("--xla_cpu_multi_thread_eigen=false")
    if flags:
        environment["XLA_FLAGS"] = " ".join(flags)
    platform = check_platform(platform)
    if platform is not None:
        environment["JAX_PLATFORMS"] = platform
    return environment


@dataclasses.dataclass(frozen=True)
class WorkerFacts:
    """What a worker says about itself: the inputs of its configuration."""

    nthreads: int
    resources: dict[str, float]
    platform: str | None = None  # the platform it was started with, if any
    host_devices: int | None = None
    group: str | None = None

    @property
    def has_accelerator(self) -> bool:
        return any(name.lower() in ACCELERATOR_RESOURCES and amount > 0 for name, amount in self.resources.items())


def worker_facts(worker: Any, environ: Mapping[str, str] | None = None) -> WorkerFacts:
    """The facts of a Dask ``worker`` and the environment its process was started with."""
    environ = os.environ if environ is None else environ
    devices = environ.get(HOST_DEVICES_VARIABLE)
    return WorkerFacts(
        nthreads=int(worker.state.nthreads),
        resources=dict(worker.state.total_resources),
        platform=environ.get(PLATFORM_VARIABLE) or environ.get("JAX_PLATFORMS") or None,
        host_devices=int(devices) if devices else None,
        group=environ.get(GROUP_VARIABLE) or None,
    )


def machine_has_accelerator() -> bool:
    """Device files of an NVIDIA, AMD or TPU accelerator on this machine (no JAX import)."""
    return any(glob.glob(pattern) for pattern in ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*"))


def choose_platform(facts: WorkerFacts, default: str | None = None) -> str | None:
    """The worker's ``JAX_PLATFORMS``: its own, none (JAX picks its accelerator), the client's, or cpu."""
    if facts.platform is not None:
        return facts.platform
    if facts.has_accelerator:
        return None
    if default is not None:
        return default
    return None if machine_has_accelerator() else "cpu"


def environment_for(facts: WorkerFacts, default_platform: str | None = None) -> dict[str, str]:
    """:func:`worker_environment` for a worker with these facts."""
    return worker_environment(max(facts.nthreads, 1), choose_platform(facts, default_platform), facts.host_devices)


def merge_xla_flags(existing: str, extra: str) -> str:
    """Append XLA flags whose names are not already present in ``existing``."""
    present = {flag.split("=", 1)[0] for flag in existing.split()}
    added = [flag for flag in extra.split() if flag.split("=", 1)[0] not in present]
    return " ".join([*existing.split(), *added])


def apply_environment(environment: Mapping[str, str], environ: dict[str, str] | None = None) -> None:
    """Write ``environment`` into ``environ`` (``os.environ`` by default), merging ``XLA_FLAGS``."""
    environ = os.environ if environ is None else environ
    for name, value in environment.items():
        if name == "XLA_FLAGS":
            environ[name] = merge_xla_flags(environ.get(name, ""), value)
        else:
            environ[name] = value


class JaxWorkerSetup(WorkerPlugin):
    """Worker plugin that configures every worker, present and future, from its own facts.

    Registered by :func:`carlskit.connect`. On each worker it applies :func:`environment_for` (its
    thread count, resources and started platform; ``platform`` is only the default for workers
    that have none of their own) and limits the thread pools of libraries already loaded (BLAS,
    through ``threadpoolctl``). The result is kept in ``worker.carlskit_config`` (shown by
    :func:`carlskit.devices`). If a worker had already imported JAX before the plugin arrived, the
    variables can no longer take effect there; the plugin records that in
    ``worker.carlskit_jax_preconfigured`` and logs a warning instead of failing.
    """

    name = "carlskit-jax-setup"

    def __init__(self, platform: str | None = None):
        self.platform = check_platform(platform)

    def setup(self, worker) -> None:  # noqa: D102 - WorkerPlugin API
        jax_was_imported = "jax" in sys.modules
        facts = worker_facts(worker)
        environment = environment_for(facts, self.platform)
        apply_environment(environment)
        try:  # numpy's BLAS was loaded with the spawn-time limits: set this worker's own
            import threadpoolctl

            threadpoolctl.threadpool_limits(limits=max(facts.nthreads, 1))
        except ImportError:  # pragma: no cover - scikit-learn brings it
            pass
        worker.carlskit_config = {"group": facts.group, "threads": facts.nthreads, "resources": facts.resources,
                                  "platform": environment.get("JAX_PLATFORMS"), "host_devices": facts.host_devices}
        worker.carlskit_jax_preconfigured = not jax_was_imported
        if jax_was_imported:
            logger.warning(
                "JAX was imported on worker %s before carlskit configured it; "
                "thread and platform settings apply only to new workers",
                worker.address,
            )
