"""One process of a :func:`carlskit.cluster.run_spmd` group: ``python -m carlskit.cluster._rank``.

A Dask worker may already have imported JAX (a maker, a remote fit), and ``jax.distributed`` must be
initialised before a backend is used, so every rank is a fresh process started by a task pinned to
its worker (:func:`carlskit.cluster._spmd.run_rank`). This module is that process's ``main``:

1. die with the worker: a thread watches the parent (``getppid``) and Linux's parent-death signal
   is set, so a SIGKILLed worker leaves no rank behind, even one blocked in a collective;
2. with ``cpus_per_process``, bind every thread to the rank's CPUs before JAX starts (its CPU thread
   pool is sized from them); then ``jax.distributed.initialize`` with the group's coordinator, size, rank and timeouts;
3. ``fn(*args)``; its value (or its error, described) is written atomically to the result file;
4. ``jax.distributed.shutdown()`` in a ``finally`` (bounded: a peer that is gone must not keep
   this process alive), then exit.

Progress records (:func:`carlskit.cluster.report_progress`) go to the task through an inherited
pipe, length-prefixed pickles (the task and this process are the same user's, on one machine).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback

#: Exit codes the task reads: the function raised (its error is in the result file), the parent died.
EXIT_RAISED, EXIT_ORPHANED = 3, 70


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):  # the kernel's guarantee, even while Python cannot run
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(EXIT_ORPHANED)

    if os.getppid() != parent:
        os._exit(EXIT_ORPHANED)
    threading.Thread(target=watch, name="carlskit-rank-parent-watch", daemon=True).start()


def _write_atomically(path: str, data: bytes) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _describe(error: BaseException) -> dict:
    """The error as the caller shows it; the exception itself when it pickles."""
    import cloudpickle

    described = {"type": type(error).__name__, "message": str(error),
                 "traceback": "".join(traceback.format_exception(error))}
    try:
        described["exception"] = cloudpickle.dumps(error)
        cloudpickle.loads(described["exception"])
    except Exception:  # noqa: BLE001 - the text is enough
        described.pop("exception", None)
    return described


def _shutdown(seconds: float) -> None:
    """``jax.distributed.shutdown()``, given up after ``seconds`` (its barrier waits for every peer)."""
    import jax

    done = threading.Event()

    def run() -> None:
        try:
            jax.distributed.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        done.set()

    threading.Thread(target=run, daemon=True).start()
    done.wait(seconds)


def main(payload_path: str, result_path: str, record_fd: int, parent: int) -> None:
    _die_with_parent(parent)
    import cloudpickle

    from carlskit.cluster import _spmd

    with open(payload_path, "rb") as file:
        spec = cloudpickle.load(file)
    _spmd._install_reporter(spec.rank, record_fd)
    if spec.cpus is not None:  # before JAX starts: its CPU thread pool is sized from these
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), spec.cpus)
    import jax

    initialized, code = False, 0
    try:
        jax.distributed.initialize(spec.coordinator, spec.size, spec.rank,
                                   initialization_timeout=int(spec.initialization_timeout),
                                   heartbeat_timeout_seconds=int(spec.heartbeat_timeout),
                                   shutdown_timeout_seconds=int(spec.shutdown_timeout))
        initialized = True
        print(f"carlskit: rank {spec.rank} of {spec.size}, pid {os.getpid()}, {jax.local_device_count()} "
              f"{jax.default_backend()} devices of {jax.device_count()}, coordinator {spec.coordinator}", flush=True)
        outcome = ("ok", spec.fn(*spec.args))
        payload = cloudpickle.dumps(outcome)
    except BaseException as error:  # noqa: BLE001 - every error goes back to the caller, described
        payload, code = cloudpickle.dumps(("error", _describe(error))), EXIT_RAISED
    _write_atomically(result_path, payload)
    sys.stdout.flush()
    sys.stderr.flush()
    if initialized and code == 0:  # a raising rank leaves its peers in a collective: no barrier
        _shutdown(spec.shutdown_timeout)
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
