"""``Trainer.fit(..., client=...)``: train on a Dask worker of a chosen group, beside its accelerator.

CARLS runs the trainer on an accelerator machine while makers and bank shards run on CPU machines
(CARLS sections 1 and 3). Here the notebook keeps its :class:`~carlskit.training.Trainer`; a fit
with ``client=`` ships the trainer's parts (model graph and state as NumPy arrays, optax
transformation, loss, knowledge function, checkpoint store) to one worker chosen by a
:class:`carlskit.cluster.Placement`, trains there, and brings the state, step and history back.
While it runs, the worker sends its history records through a Dask ``Queue`` every half second, so
the notebook's progress bar, live plot and summary writer follow as if training were local.

The trainer owns the run (``Trainer._fit_remotely`` and the worker's task ``_fit_on_worker``, both in
``_trainer.py``); this module is the transport beneath it and knows nothing of the trainer: a
:class:`RemoteFit` spec goes in (what the worker needs to rebuild the trainer), a
:class:`RemoteResult` comes out, and records reach the caller through ``on_records``.

Losing the worker costs at most ``checkpoint_every`` steps: the task is submitted again (on a live
worker of the same placement, under the trainer's restart policy), the new run restores the newest
intact checkpoint of the shared store when it is newer than the shipped state, and trains on to the
same target step. ``data`` must then be a function of the step (``f(step) -> batch``), so the
redone steps see the same batches; an iterable restarts from its beginning. The history keeps one
record per step; the records of steps the lost worker ran but had not reported yet (at most half a
second of them) and that the checkpoint kept are missing. The checkpoint store must be reachable
from the worker (a shared filesystem or an fsspec URL on a real cluster).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from carlskit.cluster import NoWorkerError, Placement, is_accelerator, live_workers, retry_on_worker_loss

REPORT_SECONDS = 0.5
#: what ``Trainer.last_placement`` records of the worker (besides its address and ``resumed_from``)
PLACEMENT_FIELDS = ("group", "host", "backend", "device_count", "device_kinds", "resources")


@dataclasses.dataclass(frozen=True)
class RemoteFit:
    """What a worker needs to rebuild a trainer and fit it to ``target_step`` (no JAX arrays:
    ``state`` is the trainer's checkpoint tree as NumPy, which travels anywhere)."""

    graphdef: Any
    state: Any
    optimizer: Any
    loss_fn: Any
    knowledge: Any
    checkpoints: Any
    checkpoint_every: int
    prefetch: int
    check_finite: bool
    array_metrics: bool
    step: int
    target_step: int
    data_parallel: str = "global"
    channel: str = dataclasses.field(default_factory=lambda: f"carlskit-fit-{uuid.uuid4().hex[:12]}")

    def channel_of(self, client: Any) -> tuple[Any, Any]:
        """The run's Dask ``Queue`` (records, worker to caller) and stop ``Event`` (caller to worker)."""
        from distributed import Event, Queue

        return Queue(self.channel, client=client), Event(f"{self.channel}-stop", client=client)


@dataclasses.dataclass(frozen=True)
class RemoteResult:
    """What a fit on a worker returns: the new state and step, the records of its steps, where it
    ran, the bank recoveries it made and its neighbour stage's missing count."""

    state: Any
    step: int
    history: list
    placement: dict
    bank_recoveries: list
    missing_neighbors: int | None


def worker_placement(resumed_from: int) -> dict:
    """This worker's address, :data:`PLACEMENT_FIELDS` and the step the fit resumed from."""
    from distributed import get_worker

    from carlskit.cluster import worker_devices

    worker = get_worker()
    devices = worker_devices(worker)
    return {"worker": worker.address, **{k: devices[k] for k in PLACEMENT_FIELDS}, "resumed_from": resumed_from}


def group_placement(resumed_from: int, processes: int) -> dict:
    """Where a process group's fit runs (in rank 0): its :data:`PLACEMENT_FIELDS` over every
    process's devices, and the step it resumed from."""
    import socket

    import jax

    return {"worker": f"{processes} processes", "group": None, "host": socket.gethostname(),
            "backend": jax.default_backend(), "device_count": jax.device_count(),
            "device_kinds": sorted({d.device_kind for d in jax.devices()}), "resources": None,
            "processes": processes, "resumed_from": resumed_from}


def run_group(task: Callable[[RemoteFit, Any], RemoteResult | None], spec: RemoteFit, client: Any, data: Any,
              placement: Placement, policy: Any, stop: threading.Event, processes: int,
              devices_per_process: int | None, *, on_records: Callable[[list[dict]], None],
              on_placement: Callable[[dict], None], on_restart: Callable[[], None]) -> tuple[RemoteResult, dict]:
    """Run ``task(spec, data)`` in every rank of a process group (:func:`carlskit.cluster.run_spmd`)
    on workers of ``placement``, relaunched under ``policy`` after a lost worker; rank 0's records
    reach ``on_records`` once each (a relaunch repeats the steps since its checkpoint). Returns
    rank 0's result and every record received, by step."""
    from carlskit.cluster import run_spmd

    received: dict[int, dict] = {}

    def on_record(record: dict) -> None:
        if "placement" in record:
            on_placement(record["placement"])
            return
        new = record["step"] not in received
        received[record["step"]] = record
        if new:
            on_records([record])

    results = run_spmd(client, task, spec, data, processes=processes, devices_per_process=devices_per_process,
                       workers=placement.workers, resources=placement.resources, restart_policy=policy,
                       on_record=on_record, stop=stop, on_restart=lambda error, delay: on_restart())
    return results[0], received


def report_until_done(spec: RemoteFit, placement: dict, history: list, done: Callable[[], bool],
                      request_stop: Callable[[], None]) -> None:
    """On the worker, while a fit runs: send ``placement`` first, then the new records of
    ``history`` every half second; pass a stop request on; return once ``done()`` and all is sent."""
    from distributed import get_client

    queue, stop = spec.channel_of(get_client())
    queue.put({"placement": placement})  # first: the notebook's status shows where the fit runs
    sent = 0
    while True:
        finished = done()
        if not finished:
            time.sleep(REPORT_SECONDS)
        records = history[sent:]
        if records:
            queue.put(list(records))
            sent += len(records)
        if finished:
            return
        if stop.is_set():
            request_stop()


def trainer_candidates(client: Any, placement: Placement, accelerators_only: bool) -> list[str]:
    """Live workers a trainer may use: the placement's when it names any; by default the
    accelerator workers (``accelerators_only``, decided once per fit: a fit that started on an
    accelerator waits for one rather than move to a CPU worker) or else every worker."""
    if placement.restricted:
        return placement.candidates(client)
    workers = live_workers(client)
    if accelerators_only:
        return sorted(a for a, info in workers.items() if is_accelerator(info.get("resources") or {}))
    return sorted(workers)


def any_accelerator_worker(client: Any) -> bool:
    workers = live_workers(client).values()
    return any(is_accelerator(info.get("resources") or {}) for info in workers)


def run_remote(task: Callable[[RemoteFit, Any], RemoteResult], spec: RemoteFit, client: Any, data: Any,
               placement: Placement, policy: Any, stop: threading.Event, *,
               on_records: Callable[[list[dict]], None], on_placement: Callable[[dict], None],
               on_restart: Callable[[], None]) -> tuple[RemoteResult, dict[int, dict]]:
    """Run ``task(spec, data)`` on a worker of ``placement`` (blocking), resubmitting it under
    ``policy`` when the worker is lost (:func:`carlskit.cluster.retry_on_worker_loss`). Records
    reach ``on_records`` once each, as they arrive; returns the task's result and every record
    received, by step (the caller merges them)."""
    queue, remote_stop = spec.channel_of(client)
    received: dict[int, dict] = {}
    accelerators_only = not placement.restricted and any_accelerator_worker(client)

    def attempt() -> RemoteResult:
        candidates = trainer_candidates(client, placement, accelerators_only)
        if not candidates:
            raise NoWorkerError(f"no live worker matches the trainer's placement ({placement})")
        # Sent once per try, straight to the chosen workers (the model, its optimizer state and
        # the data's arrays can be tens of MB): not through the scheduler in the task graph.
        parts = client.scatter([spec, data], workers=candidates, hash=False)
        future = client.submit(task, *parts, workers=candidates, allow_other_workers=False, pure=False,
                               key=f"{spec.channel}-{uuid.uuid4().hex[:6]}")
        return _follow(client, future, candidates, queue, received, stop, remote_stop, on_records, on_placement)

    # a lost worker (by type) is retried under the trainer's policy; ServiceGaveUpError once spent
    result = retry_on_worker_loss(attempt, policy=policy, what=f"training on a worker ({placement})",
                                  on_retry=lambda error, delay: on_restart())
    return result, received


def _follow(client, future, candidates, queue, received, stop, remote_stop, on_records, on_placement):
    """Wait for the task, passing its new records to ``on_records``; return its result.

    Raises :class:`NoWorkerError` (a worker loss) when every worker it may run on is gone: Dask
    would keep such a task waiting for an address that never returns (a nanny restarts a worker
    at a new address), so it is cancelled and submitted again to the live ones.
    """
    checked = time.monotonic()
    while True:
        finished = future.done()
        for batch in queue.get(batch=True):
            if isinstance(batch, dict):  # where this try runs, sent before its first record
                on_placement(batch["placement"])
                continue
            new = [record for record in batch if record["step"] not in received]
            received.update((record["step"], record) for record in batch)
            if new:
                on_records(new)
        if finished:
            return future.result()
        if stop.is_set() and not remote_stop.is_set():
            remote_stop.set()  # the worker stops after its current step and returns its state
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if not set(candidates) & set(live_workers(client)):
                future.cancel()
                raise NoWorkerError(f"the worker training this fit was lost ({', '.join(candidates)})")
        time.sleep(REPORT_SECONDS / 2)
