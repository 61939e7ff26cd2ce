"""``Trainer``: the CARLS trainer (paper section 3.3).

It trains a Flax NNX model with an optax optimizer, reads knowledge from the bank in a prefetching
input pipeline, publishes checkpoints for makers every ``checkpoint_every`` steps and resumes from
the latest one. The step itself is one pure jitted function of the model and optimizer state.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from carlskit._checks import choice, instance, positive_int
from carlskit._errors import RankFailedError
from carlskit._history import History
from carlskit._notebook import LoopDisplay
from carlskit._step import make_train_step
from carlskit._transfers import steady_state
from carlskit.bank import ShardLostError
from carlskit.checkpoints import CheckpointStore
from carlskit.cluster import Placement
from carlskit.cluster import restart_policy as restart_policy_of
from carlskit.training._embeddings import BankEmbeddings, bank_embeddings_of
from carlskit.training._knowledge import with_bank_recovery
from carlskit.training._pipeline import Batch, Prefetcher
from carlskit.training._remote import (
    RemoteFit,
    RemoteResult,
    group_placement,
    report_until_done,
    run_group,
    run_remote,
    worker_placement,
)

LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, dict[str, jax.Array]]]
#: ``Trainer(data_parallel=...)``: XLA partitions the global step, or each device's loss, averaged
DATA_PARALLEL = ("global", "local")


class FitHandle:
    """A training run in a background thread: ``stop()``, ``wait()``, ``done``."""

    def __init__(self, trainer: Trainer, thread: threading.Thread, stop: threading.Event):
        self.trainer = trainer
        self._thread = thread
        self._stop = stop
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Ask training to stop after the current step, then wait for it."""
        self._stop.set()
        self.wait()

    def request_stop(self) -> None:
        """Ask training to stop after the current step; return at once."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> History:
        """Wait for the run to end; re-raise its error if it failed; return the history.

        Raises ``TimeoutError`` if it is still running after ``timeout`` seconds (the history so far
        would look like a finished run's).
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"training still running after {timeout:g} s, at step {self.trainer.step}")
        self.trainer.show_final_frames()
        if self.error is not None:
            raise self.error
        return self.trainer.history

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return f"<FitHandle {state}, step {self.trainer.step}>"


class Trainer:
    """Train ``model`` with ``optimizer`` on batches enriched with bank knowledge.

    Args:
      model: a Flax NNX module.
      optimizer: any optax ``GradientTransformation`` (wrapped in ``nnx.Optimizer`` over
        ``nnx.Param``).
      loss_fn: ``loss_fn(model, batch) -> (loss, metrics)``; a pure function of the model and a batch
        of arrays (keys starting with ``_`` are host-side statistics and not passed to it).
      knowledge: ``knowledge(batch) -> batch`` run in the prefetch thread (e.g.
        :class:`carlskit.training.NeighborKnowledge`), so bank lookups overlap compute. A lost bank
        shard is rebuilt by the bank's ``recover()`` and the fit goes on when the bank keeps
        snapshots (``KnowledgeBank.enable_snapshots``; see ``bank_recoveries``); otherwise ``fit``
        publishes a checkpoint of the last finished step and raises ``ShardLostError`` naming the
        shard. A :class:`carlskit.training.BankEmbeddings` stage makes the model's
        :class:`~carlskit.training.BankEmbedding` tables trainable: the step also returns the
        gradients of the batch's bank rows and the trainer sends them to the bank
        (``apply_gradients_async``) without waiting; the tables are the bank's, not part of the
        trainer's checkpoints (``KnowledgeBank.enable_snapshots`` keeps them).
      checkpoints: a :class:`CheckpointStore` or a path for one; the trainer resumes from its newest intact
        checkpoint and publishes a new one every ``checkpoint_every`` steps (version = step).
      summaries: optional writer with ``scalar(name, value, step)`` (e.g. ``SummaryWriter``).
      prefetch: batches prepared ahead of the step.
      check_finite: check every step's loss and new state and commit only finite ones (one fused
        reduction over the state per step). ``False`` commits every step, as optax does
        (``MoEModel.fit`` trains this way).
      array_metrics: let ``loss_fn``'s metrics be arrays (e.g. an MoE's expert load per layer and
        expert), kept in the records as NumPy arrays and not written to ``summaries``; by default a
        non-scalar metric is a ``ValueError``.
      data_parallel: how a step over several devices (or processes) computes its gradients.
        ``"global"`` (default): XLA partitions the step over the global batch, so any loss, also
        one that couples rows (in-batch negatives), is exactly the one-device loss. ``"local"``:
        every device evaluates ``loss_fn`` on its own rows and one all-reduce of a single flat
        buffer averages the gradients, the loss and the floating metrics (PyTorch DDP's
        semantics): the same step for a loss that is a mean over rows, and faster across
        processes (XLA's CPU runtime and gloo run the global step's gradient all-reduce as one
        collective per parameter; ``BENCHMARKS.md``, one model over several processes). Not with
        bank-trained tables or a model that places its own parameters.

    The state is replicated over this process's devices and batches split over them, unless the
    model's parameters are already placed on a mesh of several devices (``MoEModel(mesh=...)``):
    then state and batches keep the shardings the model and the data gave them.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn,
        *,
        knowledge: Callable[[Batch], Batch] | None = None,
        checkpoints: CheckpointStore | str | None = None,
        checkpoint_every: int = 100,
        summaries: Any = None,
        prefetch: int = 2,
        check_finite: bool = True,
        array_metrics: bool = False,
        data_parallel: str = "global",
    ):
        instance(model, "model", nnx.Module, "a flax.nnx.Module")
        instance(optimizer, "optimizer", optax.GradientTransformation, "an optax GradientTransformation")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
        if knowledge is not None and not callable(knowledge):
            raise TypeError(f"knowledge must be callable as knowledge(batch) -> batch, got {type(knowledge).__name__}")
        if summaries is not None and not callable(getattr(summaries, "scalar", None)):
            raise TypeError(f"summaries must have a scalar(name, value, step) method, got {type(summaries).__name__}")
        checkpoint_every = positive_int(checkpoint_every, "checkpoint_every")
        self.model = model
        self.optimizer = nnx.Optimizer(model, optimizer, wrt=nnx.Param)
        self.optimizer_transform = optimizer
        self.loss_fn = loss_fn
        self.knowledge = knowledge
        #: the stage whose bank rows the step differentiates (None: no bank-trained tables)
        self.embeddings = knowledge if isinstance(knowledge, BankEmbeddings) else None
        if self.embeddings is not None:
            self.embeddings.check_model(model)
        elif bank_embeddings_of(model):
            raise ValueError("the model has BankEmbedding modules: pass knowledge=BankEmbeddings(bank, "
                             "{table: [field, ...]}) so the trainer looks their rows up")
        if isinstance(checkpoints, (str, os.PathLike)):
            checkpoints = CheckpointStore(checkpoints)
        if checkpoints is not None:
            instance(checkpoints, "checkpoints", CheckpointStore, "a CheckpointStore, a path or None")
        prefetch = positive_int(prefetch, "prefetch")
        for name, flag in (("check_finite", check_finite), ("array_metrics", array_metrics)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        self.check_finite, self.array_metrics = check_finite, array_metrics
        self.data_parallel = choice(data_parallel, "data_parallel", DATA_PARALLEL)
        if self.data_parallel == "local" and self.embeddings is not None:
            raise ValueError("data_parallel='local' cannot train BankEmbeddings tables (their rows are "
                             "looked up for the global batch); use data_parallel='global'")
        self.checkpoints = checkpoints
        self.checkpoint_every = checkpoint_every
        self.summaries = summaries
        self.prefetch = prefetch
        self.step = 0
        #: lost bank shards rebuilt during fits: {"shards", "seconds", "report"} per recovery
        self.bank_recoveries: list[dict] = []
        #: one record per step (:class:`carlskit.History`), kept across fits
        self.history = History()
        #: where the last ``fit(client=...)`` ran (or runs): worker, group, host, backend, devices,
        #: resources, and the checkpoint step it resumed from
        self.last_placement: dict | None = None
        self.remote_restarts = 0  # fits on a worker resubmitted after the worker was lost
        self._graphdef, self._state = nnx.split((self.model, self.optimizer))
        self._mesh = None if _placed_on_a_mesh(self._state) else _data_mesh()
        if self._mesh is None and self.data_parallel == "local" and _placed_on_a_mesh(self._state):
            raise ValueError("data_parallel='local' needs the trainer's data mesh, but the model places its "
                             "own parameters on a mesh (e.g. MoEModel(mesh=...)); use data_parallel='global'")
        if self._mesh is not None:
            self._state = _replicate(self._state, self._mesh)
        # No buffer donation: the model the user holds (and evaluates while training runs in the
        # background) shares arrays with the training state, and donated arrays are deleted.
        self._train_step = jax.jit(self._make_step())
        self._lock = threading.Lock()
        self._fitting = False  # one fit at a time: two would interleave steps, history and checkpoints
        self.restore()

    # -- state -----------------------------------------------------------------------------------
    def _make_step(self):
        loss_fn = self.loss_fn

        def checked_loss(model, batch):  # runs at trace time only: no cost per step
            return _check_loss_output(loss_fn(model, batch), self.array_metrics)

        return make_train_step(self._graphdef, checked_loss, check_finite=self.check_finite,
                               bank_rows=self.embeddings is not None,
                               local_mesh=self._mesh if self.data_parallel == "local" else None)

    def sync(self) -> None:
        """Copy the training state into ``self.model`` and ``self.optimizer`` (done after fit)."""
        with self._lock:
            nnx.update((self.model, self.optimizer), self._state)

    def checkpoint_tree(self) -> dict:
        # a model without variables (e.g. every table in the bank) has no entry 0 in the split state
        return {"model": self._state.get(0, nnx.State({})), "optimizer": self._state[1]}

    def save_checkpoint(self) -> int | None:
        """Publish the current state as version ``step`` (no-op without a store or if published).

        Raises ``ValueError`` naming the leaves, and publishes nothing, when a weight or optimizer
        state holds NaN or an infinity (``fit`` never commits such a step, so this guards states set
        by hand). In a process group (``fit(processes=N)``) only process 0 publishes: one stream."""
        if self.checkpoints is None or jax.process_index() != 0 or self.checkpoints.latest() == self.step:
            return None
        return self.checkpoints.save(self.checkpoint_tree(), version=self.step, metadata={"step": self.step},
                                     check_finite=True)

    def restore(self, version: int | None = None) -> bool:
        """Load the newest intact (or the given) checkpoint into the trainer; returns whether one
        was loaded. Damaged newer checkpoints are skipped (``checkpoints.corrupt_versions()`` says
        why); an explicitly requested damaged version raises :class:`carlskit.CorruptFileError`."""
        if self._fitting:
            raise RuntimeError("cannot restore while a fit is running; stop() or wait() on its FitHandle first")
        return self._restore(version)

    def _restore(self, version: int | None = None) -> bool:
        if self.checkpoints is None:
            return False
        if version is None:
            loaded = self.checkpoints.load_latest(target=self.checkpoint_tree())
            if loaded is None:
                return False
            _, tree, metadata = loaded
        else:
            tree, metadata = self.checkpoints.load(version, target=self.checkpoint_tree())
        self.adopt(tree, int(metadata.get("step", metadata["version"])))
        return True

    def adopt(self, tree: dict, step: int) -> None:
        """Make ``tree`` (a :meth:`checkpoint_tree`: ``{"model", "optimizer"}`` states) the training
        state at ``step``, placed on this process's devices, and sync it into the model."""
        self._state = nnx.State({0: tree["model"], 1: tree["optimizer"]})
        if self._mesh is not None:
            self._state = _replicate(self._state, self._mesh)
        self.step = int(step)
        self.sync()

    # -- training --------------------------------------------------------------------------------
    def fit(
        self,
        data: Iterable[Batch] | Callable[[int], Batch],
        steps: int,
        *,
        block: bool = True,
        progress: bool | str = True,
        live: bool | None = None,
        client: Any = None,
        workers: list[str] | str | None = None,
        resources: dict[str, float] | None = None,
        restart_policy: Any = None,
        processes: int | None = None,
        devices_per_process: int | None = None,
        callback: Callable[[dict], None] | None = None,
    ) -> History | FitHandle:
        """Train for ``steps`` steps on ``data`` (an iterable of batches or ``f(step) -> batch``).

        Shows a tqdm progress bar (labelled ``progress`` when it is a string, else "train"; on stderr
        outside notebooks) and, in a notebook (``live=None``), a live loss plot. With
        ``block=False`` training runs in a background thread and a :class:`FitHandle` is returned.
        Returns the history (:class:`carlskit.History`, the trainer's ``history``, kept across
        fits): one dict per step with ``step``, ``loss``, metrics and statistics, ``step_seconds``
        (the step's own time) and ``wall_time`` (``time.time()`` when it ended; not written to the
        summaries).
        Batches the pipeline prefetched but training did not reach are dropped at the end of a fit;
        an iterable that ends early ends the fit early (``len(history)`` tells how many steps ran).
        Raises ``ValueError`` when the store already holds a checkpoint newer than ``step`` (after
        ``restore`` of an older version), since this run could not publish its checkpoints there.
        ``callback(record)``, if given, sees each step's record once it is in the history (in the
        thread that trains, or follows a worker's records).

        With a Dask ``client``, the steps run on one of its workers (``workers=`` / ``resources=``,
        as :class:`carlskit.cluster.Placement`; by default an accelerator worker if there is one):
        the trainer's parts travel there, the bar, plot and summaries here follow its records, and
        the state comes back at the end (``last_placement`` says where it ran). A lost worker costs
        the steps since the last checkpoint: the fit is resubmitted under ``restart_policy`` (see
        :mod:`carlskit.training._remote`).

        With ``processes=N`` (and a ``client``) the steps run as one JAX program over ``N`` fresh
        processes on ``N`` workers (:func:`carlskit.cluster.run_spmd`; ``devices_per_process``
        simulated CPU devices each, for tests): data parallel over the global mesh of every
        process's devices, the state replicated, each process feeding its own rows of every global
        batch (``data``'s leading dimension must split over all devices), so its knowledge stage
        looks up only those rows in the bank. The result equals a one-process fit on the same
        global batches up to float summation order. Process 0 alone publishes checkpoints (one
        stream; the store must be reachable from every worker) and reports the records. Any rank's
        failure ends every rank (:class:`carlskit.RankFailedError`); a lost worker relaunches the
        group under ``restart_policy`` from the newest intact checkpoint; ``FitHandle.stop()`` ends
        the ranks at once and the trainer takes the newest checkpoint.
        """
        steps, placement = self._check_fit(steps, client, workers, resources, restart_policy)
        if processes is not None:
            processes = positive_int(processes, "processes")
            if client is None:
                raise ValueError("processes= runs the fit as a process group on Dask workers: pass client= too")
        if devices_per_process is not None:
            devices_per_process = positive_int(devices_per_process, "devices_per_process")
            if processes is None:
                raise ValueError("devices_per_process= sets each process of a group: pass processes= too")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable as callback(record), got {type(callback).__name__}")
        # Created here, in the calling thread: a notebook shows it in the cell that called fit, not in
        # whichever cell runs when a background fit's thread starts.
        display = LoopDisplay(self.history, steps, progress if isinstance(progress, str) else "train",
                              progress=bool(progress), live=live, curves=("loss", "staleness"), title="Trainer",
                              summaries=self.summaries, prefix="train/", callback=callback)
        self._display = display
        stop = threading.Event()
        self._fitting = True
        if placement is None:
            run_steps = functools.partial(self._fit, data, steps, stop, display)
        else:
            run_steps = functools.partial(self._fit_remotely, client, data, steps, placement, restart_policy,
                                          stop, display, processes, devices_per_process)
        if block:
            try:
                run_steps()
            finally:
                self._fitting = False
                self.show_final_frames()
            return self.history
        return self._start_in_background(run_steps, stop)

    def show_final_frames(self) -> None:
        """In a notebook's main thread, after a fit: make the saved output of its progress bar and
        live plot show their last state (``fit`` and ``FitHandle.wait`` call this)."""
        display, self._display = getattr(self, "_display", None), None  # once per fit
        if display is not None:
            display.show_final_frames()

    def _check_fit(self, steps: Any, client: Any, workers: Any, resources: Any,
                   restart_policy: Any) -> tuple[int, Placement | None]:
        """``fit``'s arguments checked (and the trainer able to fit) before anything starts."""
        steps = positive_int(steps, "steps")
        placement = None
        if client is not None:
            placement = Placement.of(workers, resources)
            if not callable(getattr(client, "submit", None)):
                raise TypeError(f"client must be a dask.distributed.Client, got {type(client).__name__}")
            restart_policy_of(restart_policy)  # checked now, not after the first lost worker
        elif workers is not None or resources is not None or restart_policy is not None:
            raise ValueError("workers=, resources= and restart_policy= place a fit on a Dask worker: pass client= too")
        if self._fitting:
            raise RuntimeError("this trainer is already fitting (a background fit is running); "
                               "stop() or wait() on its FitHandle first")
        latest = None if self.checkpoints is None else self.checkpoints.latest()
        if latest is not None and latest > self.step:
            raise ValueError(f"the checkpoint store {self.checkpoints.path!r} holds version {latest}, newer than "
                             f"this trainer's step {self.step}: its checkpoints would go backwards; restore() "
                             f"the latest version or train into another store")
        return steps, placement

    def _start_in_background(self, run_steps: Callable[[], None], stop: threading.Event) -> FitHandle:
        handle = None

        def run():
            try:
                run_steps()
            except BaseException as error:  # surfaced by handle.wait()
                handle.error = error
            finally:
                self._fitting = False

        thread = threading.Thread(target=run, name="carlskit-trainer", daemon=True)
        handle = FitHandle(self, thread, stop)
        thread.start()
        return handle

    def _source(self, data, first_step: int):
        if callable(data) and not hasattr(data, "__iter__"):
            counter = iter(range(first_step, 1 << 62))
            source = lambda: data(next(counter))  # noqa: E731
        else:
            iterator = iter(data)
            source = lambda: next(iterator)  # noqa: E731
        if jax.process_count() > 1 and self._mesh is not None:  # this process's rows, before the bank lookups
            return lambda: _process_rows(source(), self._mesh.devices.size)
        return source

    def _fit(self, data, steps: int, stop: threading.Event, display: LoopDisplay) -> None:
        if self.embeddings is not None:
            self.embeddings.begin()
        try:
            prefetcher = Prefetcher(self._source(data, self.step),
                                    with_bank_recovery(self.knowledge, self.bank_recoveries), self.prefetch)
        except BaseException:
            display.close()
            raise
        try:
            for index in range(steps):
                if stop.is_set():
                    break
                batch = self._next_batch(prefetcher)
                if batch is None:
                    break
                with steady_state(warm=index > 0):  # the first step may compile
                    record = self._step_on(batch)
                self.history.append(record)
                display.record(record)
                if self.step % self.checkpoint_every == 0:
                    self.sync()
                    self.save_checkpoint()
        finally:
            try:
                if self.embeddings is not None:
                    self.embeddings.end()  # wakes a lookup waiting for gradients; every push acknowledged
            finally:
                prefetcher.close()
                self.sync()
                display.close()

    def _next_batch(self, prefetcher: Prefetcher) -> Batch | None:
        """The next batch, None when the data ends; a lost bank shard that could not be rebuilt
        publishes a checkpoint of the last finished step (resumable from there) and re-raises."""
        try:
            batch = next(prefetcher)
        except StopIteration:
            return None
        except ShardLostError:  # unrecoverable (no snapshots): stop, resumable from here
            self.sync()
            self.save_checkpoint()
            raise
        if not isinstance(batch, dict):
            raise TypeError(f"each batch must be a dict of arrays, got {type(batch).__name__} "
                            f"at step {self.step + 1}")
        return batch

    def _step_on(self, batch: Batch) -> dict:
        """One step on ``batch``, committed only if its loss and new state are finite; its record."""
        statistics = {k[1:]: v for k, v in batch.items() if k.startswith("_")}
        # The batch in, the step's one intended host-to-device transfer, made explicit: without a
        # mesh _place leaves NumPy arrays that the jitted step would transfer implicitly.
        # (jax.Arrays are placed already: a process group's span other processes' devices, where a
        # device_put without a sharding cannot go.)
        arrays = {k: v if isinstance(v, jax.Array) else jax.device_put(v)
                  for k, v in self._place({k: v for k, v in batch.items() if not k.startswith("_")}).items()}
        start = time.perf_counter()
        try:
            state, loss, metrics, finite, *row_gradients = self._train_step(self._state, arrays)
        except (TypeError, ValueError) as error:  # e.g. a batch of the wrong shape for the model
            shapes = {k: (np.shape(v), str(getattr(v, "dtype", type(v).__name__))) for k, v in arrays.items()}
            kind = TypeError if isinstance(error, TypeError) else ValueError  # jax subclasses take other args
            raise kind(f"step {self.step + 1} failed on the batch {shapes} (nothing was applied): "
                       f"{error}") from error
        # the step's one host sync, metrics included (one transfer, not one per metric)
        loss, finite, row_gradients, metrics = jax.device_get((loss, finite, row_gradients, metrics))
        loss = float(loss)
        if self.check_finite and not math.isfinite(loss):  # commit nothing: the model, step and checkpoints stay finite
            raise ValueError(f"loss_fn returned a non-finite loss ({loss}) at step {self.step + 1}; "
                             f"the step was not applied (the model is as after step {self.step})")
        if not finite:
            raise ValueError(f"step {self.step + 1} produced non-finite weights or optimizer state "
                             f"(NaN or infinite gradients from a finite loss {loss}); the step was not "
                             f"applied (the model is as after step {self.step})")
        with self._lock:
            self._state = state
        if row_gradients:  # off the critical path: sent now, acknowledged before a later lookup
            self.embeddings.push(batch, row_gradients[0])
        self.step += 1
        record = {"step": self.step, "loss": loss, "step_seconds": time.perf_counter() - start,
                  "wall_time": time.time(),  # when the step ended (throughput across processes)
                  **{k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in metrics.items()},
                  **{k: float(v) for k, v in statistics.items() if np.ndim(v) == 0}}
        if "embedding_version" in record:  # knowledge read from the bank: how stale was it?
            record["staleness"] = record["step"] - 1 - record["embedding_version"]
        return record

    def _place(self, arrays: dict) -> dict:
        if self._mesh is None:
            return arrays
        size = self._mesh.devices.size
        spec = jax.sharding.PartitionSpec("data")
        replicated = jax.sharding.PartitionSpec()
        if jax.process_count() > 1:  # this process's rows (_process_rows): one global array over every process
            local = jax.local_device_count()
            return {
                k: jax.make_array_from_process_local_data(jax.sharding.NamedSharding(self._mesh, spec), np.asarray(v))
                if np.ndim(v) and np.shape(v)[0] % local == 0
                else jax.device_put(np.asarray(v), jax.sharding.NamedSharding(self._mesh, replicated))
                for k, v in arrays.items()
            }
        return {
            k: jax.device_put(v, jax.sharding.NamedSharding(
                self._mesh, spec if np.ndim(v) and np.shape(v)[0] % size == 0 else replicated))
            for k, v in arrays.items()
        }

    # -- a fit on a Dask worker (the transport: carlskit.training._remote) ------------------------
    def _remote_spec(self, steps: int) -> RemoteFit:
        """What a worker needs to rebuild this trainer and fit it ``steps`` steps on."""
        return RemoteFit(self._graphdef, jax.device_get(self.checkpoint_tree()), self.optimizer_transform,
                         self.loss_fn, self.knowledge, self.checkpoints, self.checkpoint_every, self.prefetch,
                         self.check_finite, self.array_metrics, self.step, self.step + steps,
                         self.data_parallel)

    def _fit_remotely(self, client: Any, data: Any, steps: int, placement: Placement, policy: Any,
                      stop: threading.Event, display: LoopDisplay, processes: int | None = None,
                      devices_per_process: int | None = None) -> None:
        """Run ``steps`` steps on a worker, or on a process group of ``processes`` (blocking; ``fit``
        chose the thread), then adopt its result."""
        self.sync()
        spec = self._remote_spec(steps)
        missing_before = getattr(self.knowledge, "missing_total", None)

        def on_records(records: list[dict]) -> None:
            for record in records:
                self.history.append(record)
                display.record(record)

        def on_restart() -> None:
            self.remote_restarts += 1

        try:
            if processes is None:
                result, received = run_remote(_fit_on_worker, spec, client, data, placement, policy, stop,
                                              on_records=on_records, on_placement=self._placed, on_restart=on_restart)
            else:
                result, received = run_group(_fit_in_group, spec, client, data, placement, restart_policy_of(policy),
                                             stop, processes, devices_per_process, on_records=on_records,
                                             on_placement=self._placed, on_restart=on_restart)
        except RankFailedError as error:
            if error.kind != "stopped":
                raise
            display.close()  # stopped: the ranks are gone; the newest checkpoint is where the fit got to
            if self.checkpoints is not None and (self.checkpoints.latest() or 0) > self.step:
                self._restore()
            self.history[:] = [r for r in self.history if r["step"] <= self.step]
            return
        finally:
            display.bar.close()
        self.adopt(result.state, result.step)
        received.update((record["step"], record) for record in result.history)
        self.history[:] = [r for r in self.history if r["step"] <= spec.step] + \
            [received[step] for step in sorted(received) if spec.step < step <= result.step]
        self.bank_recoveries.extend(result.bank_recoveries)
        if missing_before is not None and result.missing_neighbors is not None:
            self.knowledge.missing_total = missing_before + result.missing_neighbors
        self.last_placement = result.placement
        display.close()

    def _placed(self, placement: dict) -> None:
        self.last_placement = placement

    @classmethod
    def _from_spec(cls, spec: RemoteFit) -> Trainer:
        """On the worker: the trainer rebuilt from ``spec``, at its state or at a newer checkpoint
        of the shared store (a rerun after a lost worker resumes from there)."""
        model, _ = nnx.merge(spec.graphdef, nnx.State({0: spec.state["model"], 1: spec.state["optimizer"]}))
        trainer = cls(model, spec.optimizer, spec.loss_fn, knowledge=spec.knowledge, checkpoints=spec.checkpoints,
                      checkpoint_every=spec.checkpoint_every, prefetch=spec.prefetch, check_finite=spec.check_finite,
                      array_metrics=spec.array_metrics, data_parallel=spec.data_parallel)
        if trainer.step <= spec.step:
            trainer.adopt(spec.state, spec.step)
        return trainer

    def status(self) -> dict:
        """Step, whether a fit runs, where (this process, or the worker of a ``fit(client=...)``:
        address, group, devices; set as soon as that worker starts), and recoveries. A
        :class:`carlskit.widgets.ClusterStatus` source."""
        where = self.last_placement or {}
        return {"step": self.step, "fitting": self._fitting,
                "runs on": where.get("worker", "this process"), "group": where.get("group"),
                "devices": where.get("device_kinds"), "remote restarts": self.remote_restarts,
                "bank recoveries": len(self.bank_recoveries)}

    def evaluate(self, fn: Callable[[nnx.Module], Any]) -> Any:
        """Apply ``fn`` to the current model (synced from the training state)."""
        self.sync()
        return fn(self.model)


def _check_loss_output(output: Any, array_metrics: bool = False) -> tuple[jax.Array, dict]:
    """``loss_fn``'s ``(loss, metrics)``, checked: a scalar loss and a dict of scalar metrics
    (of arrays too with ``array_metrics``)."""
    if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], dict)):
        raise TypeError(f"loss_fn must return (loss, metrics: dict), got {type(output).__name__}")
    loss, metrics = output
    if np.ndim(loss) != 0:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {np.shape(loss)}")
    shapes = {} if array_metrics else {name: np.shape(value) for name, value in metrics.items() if np.ndim(value) != 0}
    if shapes:
        raise ValueError(f"loss_fn's metrics must be scalars, got shapes {shapes}")
    return loss, metrics


def _data_mesh() -> jax.sharding.Mesh | None:
    """A "data" mesh over every device of the program (every process's, in a process group)."""
    devices = jax.devices()
    if len(devices) < 2:
        return None
    return jax.sharding.Mesh(np.array(devices), ("data",))


def _replicate(state: Any, mesh: jax.sharding.Mesh) -> Any:
    """``state`` replicated over ``mesh``; in a process group from host copies (the same on every
    process: the same checkpoint or seed), since a device array of one process cannot be put on
    another's devices."""
    if jax.process_count() > 1:
        state = jax.device_get(state)
    return jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _process_rows(batch: Batch, global_devices: int) -> Batch:
    """This process's share of a global batch: rows ``[i * n / P, (i + 1) * n / P)`` of every
    array whose leading dimension splits over all devices (as a one-process fit splits it);
    other entries whole. Bank lookups then read only these rows."""
    index, count = jax.process_index(), jax.process_count()

    def rows(value: Any) -> Any:
        if np.ndim(value) and np.shape(value)[0] % global_devices == 0:
            share = np.shape(value)[0] // count
            return value[index * share:(index + 1) * share]
        return value

    return {k: rows(v) if not k.startswith("_") else v for k, v in batch.items()}


def _fit_in_group(spec: RemoteFit, data: Any) -> RemoteResult | None:
    """The function every rank of a ``fit(client=..., processes=N)`` runs: rebuild the trainer over
    the group's global mesh (at the newest checkpoint when a relaunch finds one), fit it to
    ``spec.target_step`` on this process's rows, rank 0 reporting its records; rank 0 returns the
    new state and what happened."""
    from carlskit.cluster import report_progress

    trainer = Trainer._from_spec(spec)
    rank = jax.process_index()
    if rank == 0:
        report_progress({"placement": group_placement(trainer.step, jax.process_count())})
    if spec.target_step > trainer.step:
        trainer.fit(data, spec.target_step - trainer.step, progress=False, live=False,
                    callback=report_progress if rank == 0 else None)
    if rank != 0:
        return None
    resumed_from = trainer.history[0]["step"] - 1 if trainer.history else trainer.step
    return RemoteResult(jax.device_get(trainer.checkpoint_tree()), trainer.step, list(trainer.history),
                        group_placement(resumed_from, jax.process_count()), trainer.bank_recoveries,
                        getattr(trainer.knowledge, "missing_total", None))


def _fit_on_worker(spec: RemoteFit, data: Any) -> RemoteResult:
    """The task a ``fit(client=...)`` submits: rebuild the trainer, fit it to ``spec.target_step``
    while reporting its records, and return the new state and what happened."""
    trainer = Trainer._from_spec(spec)
    placement = worker_placement(resumed_from=trainer.step)
    handle = trainer.fit(data, spec.target_step - trainer.step, block=False, progress=False, live=False) \
        if spec.target_step > trainer.step else None
    report_until_done(spec, placement, trainer.history, lambda: handle is None or handle.done,
                      lambda: handle.request_stop())
    if handle is not None:
        handle.wait()  # re-raises the fit's error
    return RemoteResult(jax.device_get(trainer.checkpoint_tree()), trainer.step, list(trainer.history), placement,
                        trainer.bank_recoveries, getattr(trainer.knowledge, "missing_total", None))


def _placed_on_a_mesh(state: Any) -> bool:
    """Whether some array of ``state`` is already sharded over several devices (a model that
    places its own parameters, e.g. an ``MoEModel`` with a mesh): the trainer keeps that placement."""
    return any(isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)
               and len(leaf.sharding.device_set) > 1 for leaf in jax.tree.leaves(state))
