"""``Trainer.fit(..., client=...)``: train on a Dask worker of a chosen group, beside its accelerator.

CARLS runs the trainer on an accelerator machine while makers and bank shards run on CPU machines
(CARLS sections 1 and 3). Here the notebook keeps its :class:`~carlskit.training.Trainer`; a fit
with ``client=`` ships the trainer's parts (model graph and state as NumPy arrays, optax
transformation, loss, knowledge function, checkpoint store) to one worker chosen by a
:class:`carlskit.cluster.Placement`, trains there, and brings the state, step and history back.
While it runs, the worker sends its history records through a Dask ``Queue`` every half second, so
the notebook's progress bar, live plot and summary writer follow as if training were local.

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
from typing import Any

import jax

from carlskit._notebook import step_done
from carlskit.cluster import NoWorkerError, Placement, is_accelerator, retry_on_worker_loss

REPORT_SECONDS = 0.5
#: what ``Trainer.last_placement`` records of the worker (besides its address and ``resumed_from``)
PLACEMENT_FIELDS = ("group", "host", "backend", "device_count", "device_kinds", "resources")


@dataclasses.dataclass
class _Shipped:
    """Everything a worker needs to rebuild the trainer (no JAX arrays: NumPy travels anywhere)."""

    graphdef: Any
    state: Any
    optimizer: Any
    loss_fn: Any
    knowledge: Any
    checkpoints: Any
    checkpoint_every: int
    prefetch: int
    step: int
    queue: str


def trainer_candidates(client: Any, placement: Placement, accelerators_only: bool) -> list[str]:
    """Live workers a trainer may use: the placement's when it names any; by default the
    accelerator workers (``accelerators_only``, decided once per fit: a fit that started on an
    accelerator waits for one rather than move to a CPU worker) or else every worker."""
    if placement.restricted:
        return placement.candidates(client)
    workers = client.scheduler_info(n_workers=-1)["workers"]
    if accelerators_only:
        return sorted(a for a, info in workers.items() if is_accelerator(info.get("resources") or {}))
    return sorted(workers)


def any_accelerator_worker(client: Any) -> bool:
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    return any(is_accelerator(info.get("resources") or {}) for info in workers)


def _fit_on_this_worker(shipped: _Shipped, data: Any, target_step: int) -> dict:
    """The task: rebuild the trainer, adopt the shipped state (or a newer checkpoint), fit to
    ``target_step`` while reporting records, and return the new state and what happened."""
    from distributed import Event, Queue, get_client, get_worker
    from flax import nnx

    from carlskit.cluster import worker_devices
    from carlskit.training._trainer import Trainer

    worker = get_worker()
    model, _ = nnx.merge(shipped.graphdef, nnx.State({0: shipped.state["model"], 1: shipped.state["optimizer"]}))
    trainer = Trainer(model, shipped.optimizer, shipped.loss_fn, knowledge=shipped.knowledge,
                      checkpoints=shipped.checkpoints, checkpoint_every=shipped.checkpoint_every,
                      prefetch=shipped.prefetch)
    if trainer.step <= shipped.step:  # a checkpoint newer than the shipped state: a rerun after a loss
        trainer.adopt(shipped.state, shipped.step)
    resumed_from = trainer.step
    client = get_client()
    queue, stop = Queue(shipped.queue, client=client), Event(f"{shipped.queue}-stop", client=client)
    devices = worker_devices(worker)
    placement = {"worker": worker.address, **{k: devices[k] for k in PLACEMENT_FIELDS}, "resumed_from": resumed_from}
    queue.put({"placement": placement})  # first: the notebook's status shows where the fit runs
    handle = trainer.fit(data, target_step - trainer.step, block=False, progress=False, live=False) \
        if target_step > trainer.step else None
    sent = 0
    while True:  # report records every half second; pass a stop request on
        if handle is not None and not handle.done:
            time.sleep(REPORT_SECONDS)
        records = trainer.history[sent:]
        if records:
            queue.put(records)
            sent += len(records)
        if handle is None or handle.done:
            break
        if stop.is_set():
            handle.request_stop()
    if handle is not None:
        handle.wait()  # re-raises the fit's error
    return {"state": jax.device_get(trainer.checkpoint_tree()), "step": trainer.step,
            "history": trainer.history, "placement": placement, "bank_recoveries": trainer.bank_recoveries,
            "missing_neighbors": getattr(trainer.knowledge, "missing_total", None)}


def fit_on_worker(trainer: Any, client: Any, data: Any, steps: int, placement: Placement,
                  policy: Any, stop: threading.Event, bar: Any, plot: Any) -> None:
    """Run ``steps`` steps of ``trainer`` on a worker (blocking; ``Trainer.fit`` chose the thread)."""
    from distributed import Event, Queue

    trainer.sync()
    start_step, target = trainer.step, trainer.step + steps
    name = f"carlskit-fit-{uuid.uuid4().hex[:12]}"
    queue, remote_stop = Queue(name, client=client), Event(f"{name}-stop", client=client)
    shipped = _Shipped(trainer._graphdef, jax.device_get(trainer.checkpoint_tree()), trainer.optimizer_transform,
                       trainer.loss_fn, trainer.knowledge, trainer.checkpoints, trainer.checkpoint_every,
                       trainer.prefetch, start_step, name)
    received: dict[int, dict] = {}
    missing_before = getattr(trainer.knowledge, "missing_total", None)
    accelerators_only = not placement.restricted and any_accelerator_worker(client)

    def attempt() -> dict:
        candidates = trainer_candidates(client, placement, accelerators_only)
        if not candidates:
            raise NoWorkerError(f"no live worker matches the trainer's placement ({placement})")
        # Sent once per try, straight to the chosen workers (the model, its optimizer state and
        # the data's arrays can be tens of MB): not through the scheduler in the task graph.
        parts = client.scatter([shipped, data], workers=candidates, hash=False)
        future = client.submit(_fit_on_this_worker, *parts, target, workers=candidates,
                               allow_other_workers=False, pure=False, key=f"{name}-{uuid.uuid4().hex[:6]}")
        return _follow(trainer, client, future, candidates, queue, received, stop, remote_stop, bar, plot)

    def count_restart(error: BaseException, delay: float) -> None:
        trainer.remote_restarts += 1

    try:  # a lost worker (by type) is retried under the trainer's policy; ServiceGaveUpError once spent
        result = retry_on_worker_loss(attempt, policy=policy, what=f"training on a worker ({placement})",
                                      on_retry=count_restart)
    finally:
        bar.close()
    trainer.adopt(result["state"], result["step"])
    for record in result["history"]:
        received[record["step"]] = record
    trainer.history[:] = [r for r in trainer.history if r["step"] <= start_step] + \
        [received[step] for step in sorted(received) if start_step < step <= result["step"]]
    trainer.bank_recoveries.extend(result["bank_recoveries"])
    if missing_before is not None and result["missing_neighbors"] is not None:
        trainer.knowledge.missing_total = missing_before + result["missing_neighbors"]
    trainer.last_placement = result["placement"]
    if plot is not None:
        plot.update(trainer._series(), force=True)


def _follow(trainer, client, future, candidates, queue, received, stop, remote_stop, bar, plot) -> dict:
    """Wait for the task, feeding its records to the bar, plot and summaries; return its result.

    Raises :class:`NoWorkerError` (a worker loss) when every worker it may run on is gone: Dask
    would keep such a task waiting for an address that never returns (a nanny restarts a worker
    at a new address), so it is cancelled and submitted again to the live ones.
    """
    checked = time.monotonic()
    while True:
        finished = future.done()
        for batch in queue.get(batch=True):
            if isinstance(batch, dict):  # where this try runs, sent before its first record
                trainer.last_placement = batch["placement"]
                continue
            for record in batch:
                if record["step"] not in received:
                    trainer.history.append(record)
                    trainer._log(record)
                    step_done(bar, record["loss"])
                received[record["step"]] = record
        if plot is not None:
            plot.update(trainer._series())
        if finished:
            return future.result()
        if stop.is_set() and not remote_stop.is_set():
            remote_stop.set()  # the worker stops after its current step and returns its state
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if not set(candidates) & set(client.scheduler_info(n_workers=-1)["workers"]):
                future.cancel()
                raise NoWorkerError(f"the worker training this fit was lost ({', '.join(candidates)})")
        time.sleep(REPORT_SECONDS / 2)
