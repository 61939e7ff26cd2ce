"""``MetaTraining``: the learned-optimizer training cluster of Metz et al. (2022), Appendix H.1, on Dask.

    ES workers ──put_many──▶ GradientStore ◀──take_many── Learner ──checkpoints──▶ CheckpointStore
        ▲                                                    │                         │
        └────────────── current() (outer step, θ) ───────────┘           EvaluationChief ─▶ eval jobs

One object starts, watches and stops it all from a notebook. With a Dask client the store and the
learner are actors on one worker (the "service" worker), the ES workers are long-running tasks on
the others (:class:`carlskit.cluster._supervised.LongRunningTasks` relaunches any that fail or lose
their worker), and evaluation jobs are ordinary tasks. Without a client everything runs in threads
of this process. A driver thread here calls ``learner.update()`` in a loop; if the learner's
worker dies, it rebuilds store and learner, and the new learner resumes from its latest checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import html
import logging
import os
import pathlib
import threading
import time
import traceback
import uuid
from typing import Any

import numpy as np
import optax

from carlskit.cluster._supervised import MAX_KEPT_ERRORS, LongRunningTasks, stop_flag
from carlskit.lopt._es_worker import ESWorkerConfig, run_es_worker
from carlskit.lopt._evaluation import EvalTaskSet, EvaluationChief, default_eval_task_sets, load_meta_params_checkpoint
from carlskit.lopt._checks import integer, positive_float, positive_int
from carlskit.lopt._gradient_store import GradientStore, call
from carlskit.lopt._learner import Learner
from carlskit.lopt._optimizer import LearnedOptimizer
from carlskit.lopt._tasks import Task, TaskFamily
from carlskit.training import CheckpointStore

logger = logging.getLogger("carlskit.lopt.meta_training")


class MetaTraining:
    """Meta-train ``lopt`` on ``task_family`` with ES workers, a gradient store, a learner and an
    evaluation chief (Metz et al. 2022, App. H.1).

    Args:
      lopt: the :class:`LearnedOptimizer` to train (its meta-parameters are the start, else random).
      task_family: a :class:`TaskFamily` (or one :class:`Task`) the ES workers sample from.
      client: a ``distributed.Client`` (e.g. ``carlskit.connect()``) or ``None`` (threads here).
      directory: run directory: ``checkpoints/``, ``evaluation/`` and ``summaries/`` go under it.
      num_workers: ES worker loops.
      eval_workers: evaluation jobs in flight at most.
      num_tasks, num_steps, std: antithetic pairs per estimate, inner steps per unroll, ES noise.
      max_staleness: gradients older than this many outer steps are dropped (paper: 5).
      outer_optimizer: optax optimizer of the meta-parameters (default ``optax.adam(3e-3)``).
      checkpoint_every_seconds: learner checkpoint period (paper: 600).
      eval_task_sets: fixed evaluation sets (default :func:`default_eval_task_sets`).
      ood_tasks: out-of-distribution tasks for the default evaluation sets.
      eval_num_steps: inner steps of evaluation runs.
      max_gradients_per_update: records the learner takes per update.
      seed: seeds initial meta-parameters (when ``lopt`` has none) and the workers' streams.
    """

    def __init__(self, lopt: LearnedOptimizer, task_family: TaskFamily | Task, client: Any = None, *,
                 directory: str | os.PathLike, num_workers: int = 2, eval_workers: int = 1, num_tasks: int = 8,
                 num_steps: int = 50, std: float = 0.01, max_staleness: int = 5,
                 outer_optimizer: optax.GradientTransformation | None = None,
                 checkpoint_every_seconds: float = 600.0, eval_task_sets: list[EvalTaskSet] | None = None,
                 ood_tasks: tuple[Task, ...] = (), eval_num_steps: int | None = None,
                 max_gradients_per_update: int = 64, put_every: int = 1, seed: int = 0,
                 evaluate: bool = True, summaries: bool = True) -> None:
        from carlskit.lopt._optimizer import _SingleTaskFamily

        if not isinstance(lopt, LearnedOptimizer):
            raise TypeError(f"lopt must be a LearnedOptimizer, got {type(lopt).__name__}")
        family = _SingleTaskFamily(task_family) if isinstance(task_family, Task) else task_family
        if not isinstance(family, TaskFamily):
            raise TypeError(f"task_family must be a TaskFamily or Task, got {type(task_family).__name__}")
        for name, value in (("num_workers", num_workers), ("eval_workers", eval_workers), ("num_tasks", num_tasks),
                            ("num_steps", num_steps), ("max_gradients_per_update", max_gradients_per_update)):
            positive_int(value, name)
        integer(max_staleness, "max_staleness", 0)  # here, not only when start() builds the learner
        positive_float(checkpoint_every_seconds, "checkpoint_every_seconds")
        self.lopt, self.family, self.client = lopt, family, client
        self.directory = pathlib.Path(directory)
        self.checkpoint_path = str(self.directory / "checkpoints")
        self.eval_dir = self.directory / "evaluation"
        self.logdir = str(self.directory / "summaries") if summaries else None
        self.num_workers, self.eval_workers = num_workers, eval_workers
        self.worker_config = ESWorkerConfig(num_tasks, num_steps, std, "mean", put_every, seed)
        self.learner_options = dict(initial_meta_params=lopt.meta_params, outer_optimizer=outer_optimizer,
                                    max_staleness=max_staleness, max_gradients_per_update=max_gradients_per_update,
                                    checkpoint_every_seconds=checkpoint_every_seconds, logdir=self.logdir,
                                    seed=seed)
        eval_steps = num_steps if eval_num_steps is None else eval_num_steps
        self.eval_task_sets = eval_task_sets if eval_task_sets is not None else default_eval_task_sets(
            family, ood_tasks=tuple(ood_tasks), num_steps=eval_steps)
        self.evaluate = evaluate
        self.learner: Any = None
        self.gradient_store: Any = None
        self.chief: EvaluationChief | None = None
        self.learner_restarts = 0
        self.learner_errors: collections.deque[str] = collections.deque(maxlen=MAX_KEPT_ERRORS)  # the last ones
        self.learner_error_count = 0
        self.eval_results: dict[int, dict] = {}
        self._actor_futures: list = []
        self._service_worker: str | None = None
        self._tasks: LongRunningTasks | None = None
        self._stop = None
        self._driver: threading.Thread | None = None
        self._driving = threading.Event()
        self._topic = f"carlskit-meta-training-{uuid.uuid4().hex[:8]}"
        self._last_learner_status: dict = {}
        self._widgets: dict[str, Any] = {}

    # ------------------------------------------------------------------ services
    def _workers(self) -> list[str]:
        return sorted(self.client.scheduler_info(n_workers=-1)["workers"])

    def _start_services(self) -> None:
        """Create the gradient store and the learner (resuming from the latest checkpoint)."""
        if self.client is None:
            store = GradientStore()
            self.learner = Learner(self.lopt.rule, store, self.checkpoint_path, **self.learner_options)
            self.gradient_store = store
            return
        for future in self._actor_futures:
            future.release()
        workers = self._workers()
        self._service_worker = workers[0]
        placement = dict(workers=[self._service_worker], allow_other_workers=True, pure=False)
        store_future = self.client.submit(GradientStore, actor=True, key=f"gradient-store-{uuid.uuid4().hex[:8]}",
                                          **placement)
        store = store_future.result()
        learner_future = self.client.submit(Learner, self.lopt.rule, store, self.checkpoint_path, actor=True,
                                            key=f"learner-{uuid.uuid4().hex[:8]}", **placement,
                                            **self.learner_options)
        self.learner = learner_future.result()
        self.gradient_store = store
        self._actor_futures = [store_future, learner_future]

    def _es_worker_placement(self, index: int) -> list[str] | None:
        """ES worker ``index`` prefers the ``index``-th worker other than the learner's (round robin)."""
        if self.client is None:
            return None
        others = [w for w in self._workers() if w != self._service_worker]
        return [others[index % len(others)]] if others else None

    def _worker_args(self, index: int):
        return lambda: (index, self.learner, self.gradient_store, self.family, self.lopt.rule, self.worker_config,
                        self._stop, self._topic, self.logdir)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> MetaTraining:
        """Start store, learner, ES workers, the learner's driver and the evaluation chief; returns self."""
        if self._driver is not None:
            raise RuntimeError("this MetaTraining is already running; stop() it first")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._start_services()
        self._stop = stop_flag(self.client, f"{self._topic}-stop")
        if self.evaluate:
            self.chief = EvaluationChief(
                self.lopt.rule, self.checkpoint_path, self.eval_dir, self.eval_task_sets, client=self.client,
                eval_workers=self.eval_workers, time_scale=self.worker_config.num_steps / self.eval_task_sets[0].num_steps,
                logdir=self.logdir, on_result=self._on_eval_result)
            self.eval_results.update(self.chief.results())
        self._tasks = LongRunningTasks(self.client, f"es-worker-{self._topic[-8:]}", piece="worker",
                                       on_poll=self._poll_chief)
        for index in range(self.num_workers):
            self._tasks.launch(str(index), run_es_worker, self._worker_args(index),
                               workers=self._es_worker_placement(index))
        self._driving.set()
        self._driver = threading.Thread(target=self._drive_learner, name="meta-training-learner", daemon=True)
        self._driver.start()
        return self

    def _poll_chief(self) -> None:
        if self.chief is not None:
            self.chief.poll()

    def _on_eval_result(self, version: int, curves: dict) -> None:
        self.eval_results[version] = curves
        widget = self._widgets.get("eval_curves")
        if widget is not None:
            widget.add({version: curves})

    def _learner_alive(self) -> bool:
        return self.client is None or all(f.status == "finished" for f in self._actor_futures)

    def _drive_learner(self) -> None:
        while self._driving.is_set():
            try:
                result = call(self.learner, "update", timeout=60)
                if not result["taken"]:
                    time.sleep(0.01)
            except Exception as error:
                if not self._driving.is_set():
                    return
                self._record_learner_error(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
                logger.error("learner update failed: %r", error)
                if self.client is not None and self.client.status != "running":
                    return
                time.sleep(0.2)
                # Its worker is gone (comm error, "Worker holding Actor was lost"): rebuild. Any other
                # error is the learner's own: recorded above, and the next update tries again.
                if not self._learner_alive() or isinstance(error, OSError) or "lost" in str(error):
                    self._restart_services()

    def _record_learner_error(self, message: str) -> None:
        self.learner_errors.append(message)
        self.learner_error_count += 1

    def _restart_services(self) -> None:
        """The learner's worker is gone: rebuild store and learner; workers pick them up when relaunched."""
        try:
            self._start_services()
            self.learner_restarts += 1
            logger.warning("learner restarted from checkpoint %s", call(self.learner, "status")["resumed_from"])
        except Exception as error:
            self._record_learner_error(f"restart failed: {error!r}")
            time.sleep(0.5)

    def stop(self, timeout: float = 60.0, *, evaluate_final: bool = True) -> None:
        """Stop the workers and the driver, checkpoint the learner's latest meta-parameters, evaluate
        that final checkpoint (``evaluate_final``, waiting up to ``timeout``), and stop the chief.
        Checkpoints not evaluated yet are left for the next chief over the same directory."""
        if self._driver is None:
            return
        try:
            if self._tasks is not None:
                self._tasks.stop(self._stop, timeout)
        finally:
            self._driving.clear()
            self._driver.join(timeout)
            self._driver = None
            try:
                self._stop_services(timeout, evaluate_final)
            finally:
                for future in self._actor_futures:
                    future.release()
                self._actor_futures = []
        for widget in self._widgets.values():  # a last refresh showing the final state, then stop
            for method in ("update", "refresh", "stop"):
                if hasattr(widget, method):
                    with contextlib.suppress(Exception):
                        getattr(widget, method)()

    def _stop_services(self, timeout: float, evaluate_final: bool) -> None:
        """Close the learner (a last checkpoint), evaluate that checkpoint, close the chief: each step
        whatever the previous one raised (errors are recorded and logged, never stop the shutdown)."""
        try:
            self._last_learner_status = call(self.learner, "status", timeout=timeout)
            call(self.learner, "close", timeout=timeout)
        except Exception as error:  # its worker may be gone; the checkpoints on disk remain
            self._record_learner_error(f"close failed: {error!r}")
        if self.chief is None:
            return
        try:
            final = self.chief.checkpoints.latest()
            if evaluate_final and final is not None:
                self.chief.wait(final, timeout)
        except Exception as error:  # timed out, checkpoint failed evaluation, chief broken: still close it
            logger.warning("final evaluation not done: %r", error)
        finally:
            self.chief.close()

    # ------------------------------------------------------------------ results
    def learner_status(self) -> dict[str, Any]:
        """The learner's figures (outer step, gradients/s, staleness histogram, dropped fraction...)."""
        if self._driver is None:
            return dict(self._last_learner_status)
        try:
            self._last_learner_status = call(self.learner, "status", timeout=30)
        except Exception as error:
            return {**self._last_learner_status, "error": repr(error)}
        return dict(self._last_learner_status)

    def status(self) -> dict[str, Any]:
        """One dict for ``ClusterStatus``: learner, store, workers, restarts, errors, evaluation."""
        learner = self.learner_status()
        report = {key: learner.get(key) for key in ("outer_step", "resumed_from", "outer_loss",
                                                    "gradients_per_second", "dropped_fraction", "received",
                                                    "applied", "rejected", "latest_checkpoint",
                                                    "mean_update_seconds")}
        report["staleness_counts"] = learner.get("staleness_counts")
        try:
            report["store"] = call(self.gradient_store, "status", timeout=30) if self.gradient_store else None
        except Exception as error:
            report["store"] = repr(error)
        report["es_workers"] = self.num_workers
        report["es_workers_running"] = len(self._tasks.running()) if self._tasks is not None else 0
        report["worker_restarts"] = self._tasks.restarts if self._tasks is not None else 0
        report["worker_errors"] = self._tasks.error_count if self._tasks is not None else 0
        report["learner_restarts"] = self.learner_restarts
        if self.chief is not None:
            report["evaluation"] = self.chief.status()
        report["families"] = [{"task_family": name, **values}
                              for name, values in (learner.get("family_losses") or {}).items()]
        return report

    @property
    def name(self) -> str:
        return "meta-training"

    def checkpoints(self) -> CheckpointStore:
        return CheckpointStore(self.checkpoint_path, keep=None)

    def best_checkpoint(self, task_set: str = "heldout", split: str = "valid") -> int:
        """The evaluated checkpoint with the lowest mean ``split`` loss on ``task_set``."""
        if not self.eval_results:
            raise ValueError("no checkpoint has been evaluated yet")
        names = {s.name for s in self.eval_task_sets}
        if task_set not in names:
            raise ValueError(f"task_set must be one of {sorted(names)}, got {task_set!r}")
        return min(self.eval_results, key=lambda v: float(np.mean(self.eval_results[v][task_set][split])))

    def learned_optimizer(self, version: int | None = None) -> LearnedOptimizer:
        """A :class:`LearnedOptimizer` with the meta-parameters of checkpoint ``version`` (default latest)."""
        meta_params, metadata = load_meta_params_checkpoint(self.checkpoints(), self.lopt.rule, version)
        info = {**self.lopt.info, "checkpoint": metadata["version"], "outer_step": metadata.get("outer_step")}
        return LearnedOptimizer(self.lopt.rule, meta_params, self.worker_config.num_steps, info)

    # ------------------------------------------------------------------ display
    def dashboard(self, every_seconds: float = 1.0):
        """Live view: outer loss, gradients/s and dropped fraction (``LiveSummaries``), the staleness
        histogram, the evaluation curves per checkpoint (``EvalCurves``) and the cluster status."""
        import ipywidgets

        from carlskit.widgets import ClusterStatus, EvalCurves, LiveSummaries

        if self.logdir is None:
            raise ValueError("dashboard needs summaries=True")
        live = LiveSummaries(self.logdir, ["learner/outer_loss", "learner/gradients_per_second",
                                           "learner/dropped_fraction"], every_seconds=every_seconds)
        curves = EvalCurves({v: c for v, c in sorted(self.eval_results.items())})
        board = ClusterStatus(self.client, sources=[self], every_seconds=every_seconds, show_devices=False)
        staleness = StalenessHistogram(self, every_seconds=every_seconds)
        self._widgets.update(live=live, eval_curves=curves, status=board, staleness=staleness)
        if self._driver is not None:  # refresh while training runs, displayed or not
            live.start()
            board._on_display()
        return ipywidgets.VBox([live.widget, staleness.widget, curves.widget, board.widget])

    def _repr_html_(self) -> str:
        status = self.status()
        rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                       for k, v in status.items() if k != "families")
        return f"<b>MetaTraining</b> {html.escape(str(self.directory))}<table>{rows}</table>"

    def __repr__(self) -> str:
        state = "running" if self._driver is not None else "stopped"
        return (f"<MetaTraining {state}: {self.num_workers} ES workers, {self.eval_workers} eval workers, "
                f"outer step {self._last_learner_status.get('outer_step')}>")


class StalenessHistogram:
    """A bar chart of the learner's staleness counts and dropped fraction, refreshed in place."""

    def __init__(self, training: MetaTraining, every_seconds: float = 1.0) -> None:
        import ipywidgets

        from carlskit.widgets._display import PeriodicThread

        self.training = training
        self.widget = ipywidgets.Image(format="png")
        self._updater = PeriodicThread(self.update, every_seconds, "carlskit-staleness")
        self.update()
        self._updater.start()

    def update(self) -> None:
        from carlskit.widgets._display import render_png

        status = self.training.learner_status()
        counts = status.get("staleness_counts") or []
        max_staleness = self.training.learner_options["max_staleness"]

        def draw(figure):
            axes = figure.add_subplot(1, 1, 1)
            bins = np.arange(len(counts))
            axes.bar(bins, counts, color=["C0" if b <= max_staleness else "C3" for b in bins])
            axes.set_xlabel("staleness (outer steps; last bin: that many or more)", fontsize=8)
            axes.set_ylabel("gradients", fontsize=8)
            axes.set_title(f"staleness; dropped fraction {status.get('dropped_fraction', 0.0):.3f} "
                           f"(max_staleness {max_staleness})", fontsize=9)

        self.widget.value = render_png(draw, 7.0, 2.2)

    def stop(self) -> None:
        self._updater.stop()
