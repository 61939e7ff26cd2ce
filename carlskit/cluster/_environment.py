"""Process environment for JAX on Dask workers.

XLA, OpenMP (faiss), and BLAS read their settings from environment variables once, when they are
first imported. A worker must therefore be configured before any task imports JAX: for workers that
carlskit spawns (the embedded ``LocalCluster``) the variables go into
``distributed.nanny.pre-spawn-environ`` so the worker process starts with them; for workers of any
other deployment the :class:`JaxWorkerSetup` plugin sets them when it is registered, which is before
the first carlskit task runs there.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from distributed.diagnostics.plugin import WorkerPlugin

logger = logging.getLogger(__name__)

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_VALID_PLATFORMS = {"cpu", "gpu", "cuda", "rocm", "tpu"}


def worker_environment(threads: int = 1, platform: str | None = None) -> dict[str, str]:
    """Environment variables for a process that may import JAX and faiss.

    Args:
      threads: threads the process may use for XLA, OpenMP (faiss) and BLAS; usually Dask's
        ``threads_per_worker``, so that workers sharing a machine do not oversubscribe its cores.
      platform: value for ``JAX_PLATFORMS`` (``"cpu"``, ``"gpu"``, ``"tpu"``, or a comma list);
        ``None`` lets JAX pick the best backend present.

    Returns:
      A dict of variable names to string values: thread limits, no GPU memory preallocation (so
      several processes can share one accelerator), and the platform when one is given.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    environment = {name: str(threads) for name in _THREAD_VARIABLES}
    environment["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if threads == 1:
        environment["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
    if platform is not None:
        names = [name.strip() for name in platform.split(",") if name.strip()]
        unknown = [name for name in names if name not in _VALID_PLATFORMS]
        if not names or unknown:
            raise ValueError(
                f"platform must name JAX platforms from {sorted(_VALID_PLATFORMS)}, got {platform!r}"
            )
        environment["JAX_PLATFORMS"] = ",".join(names)
    return environment


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
    """Worker plugin that applies :func:`worker_environment` on every worker, present and future.

    Registered by :func:`carlskit.connect`. If a worker had already imported JAX before the plugin
    arrived, the variables can no longer take effect there; the plugin records that in
    ``worker.carlskit_jax_preconfigured`` and logs a warning instead of failing.
    """

    name = "carlskit-jax-setup"

    def __init__(self, environment: Mapping[str, str]):
        self.environment = dict(environment)

    def setup(self, worker) -> None:  # noqa: D102 - WorkerPlugin API
        jax_was_imported = "jax" in sys.modules
        apply_environment(self.environment)
        worker.carlskit_jax_preconfigured = not jax_was_imported
        if jax_was_imported:
            logger.warning(
                "JAX was imported on worker %s before carlskit configured it; "
                "thread and platform settings apply only to new workers",
                worker.address,
            )
