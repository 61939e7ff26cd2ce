"""``MetaTraining``: the learned-optimizer training cluster of Metz et al. (2020), Appendix H.1, on Dask.

    ES workers ──put_many──▶ GradientStore ◀──take_many── Learner ──checkpoints──▶ CheckpointStore
        ▲                                                    │                         │
        └────────────── current() (outer step, θ) ───────────┘           EvaluationChief ─▶ eval jobs

One object starts, watches and stops it all from a notebook. With a Dask client the store and the
learner are actors on one worker (the "service" worker), the ES workers are long-running tasks on
the others, and evaluation jobs are ordinary tasks. Without a client everything runs in threads of
this process. A driver thread here calls ``learner.update()`` in a loop. The ES workers and the
learner are the two halves of the outer core (:mod:`carlskit.lopt._outer`: ``worker_estimate``,
``learner_apply``) that ``LearnedOptimizer.meta_train`` runs in one process.

Supervision (the service kit of :mod:`carlskit.cluster`: one :class:`RestartPolicy` for every
service, a budget in seconds, default 10 minutes; loss decided by type and actor state, never
message text):

* **Learner and gradient store** (two :class:`carlskit.cluster.ActorHost` s on one worker, driven
  and supervised by :class:`~carlskit.lopt._learner_service.LearnerService`): when their worker is
  lost they are rebuilt on a live worker under the learner's :class:`carlskit.cluster.ServiceState`
  and resume from the newest intact checkpoint (at most ``checkpoint_every_seconds`` of progress
  lost and re-done); :attr:`MetaTraining.recoveries` records each outage.
* **ES workers** (:class:`LongRunningTasks` with ``hold``): while the learner is known to be down,
  an ES worker whose call on it fails *waits* (state ``"waiting"``): no failure counted, no relaunch
  against the dead actors; all are relaunched with the new actors as soon as the learner is back.
  So an outage of any length up to the learner's budget costs the ES workers no budget. Failures
  of their own (their worker lost, errors) are relaunched with backoff, on another worker if needed.
* **Evaluation workers**: jobs lost with their worker are retried by the
  :class:`EvaluationChief` under the same policy; each checkpoint is evaluated exactly once.

A service that gives up says so in :meth:`MetaTraining.status` (``services``, shown by
``ClusterStatus``) and :meth:`MetaTraining.wait` raises :class:`carlskit.ServiceGaveUpError`.
"""

from __future__ import annotations

import contextlib
import html
import logging
import os
import pathlib
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import optax

from carlskit._checks import integer, positive_float, positive_int
from carlskit._errors import ServiceGaveUpError
from carlskit.checkpoints import CheckpointStore
from carlskit.cluster import LongRunningTasks, Placement, RestartPolicy, ServiceStatus, stop_flag
from carlskit.cluster import restart_policy as restart_policy_of
from carlskit.lopt._es_worker import ESWorkerConfig, run_es_worker
from carlskit.lopt._evaluation import EvalTaskSet, EvaluationChief, default_eval_task_sets, load_meta_params_checkpoint
from carlskit.lopt._learner import load_newest_intact
from carlskit.lopt._learner_service import LearnerService
from carlskit.lopt._optimizer import LearnedOptimizer
from carlskit.lopt._outer import outer_optimizer_of
from carlskit.lopt._protocols import Task, TaskFamily
from carlskit.lopt._tasks import as_task_family

logger = logging.getLogger("carlskit.lopt.meta_training")


SERVICE_ROLES = ("learner", "es_workers", "eval_workers")


def service_placements(workers: list[str] | str | None, resources: Mapping[str, float] | None,
                       placement: Mapping[str, Placement | Mapping[str, Any]] | None) -> dict[str, Placement]:
    """One :class:`Placement` per role: ``placement[role]`` if given, else ``workers``/``resources``."""
    default = Placement.of(workers, resources)
    placements = {role: default for role in SERVICE_ROLES}
    if placement is None:
        return placements
    if not isinstance(placement, Mapping):
        raise TypeError(f"placement must be a dict of role -> Placement or dict, got {type(placement).__name__}")
    unknown = sorted(set(placement) - set(SERVICE_ROLES))
    if unknown:
        raise ValueError(f"placement has unknown roles {unknown}; roles: {list(SERVICE_ROLES)}")
    for role, value in placement.items():
        if isinstance(value, Placement):
            placements[role] = value
        elif isinstance(value, Mapping):
            extra = sorted(set(value) - {"workers", "resources"})
            if extra:
                raise ValueError(f"placement[{role!r}] has unknown keys {extra}; keys: ['workers', 'resources']")
            placements[role] = Placement.of(value.get("workers"), value.get("resources"))
        else:
            raise TypeError(f"placement[{role!r}] must be a Placement or a dict, got {type(value).__name__}")
    return placements


class MetaTraining:
    """Meta-train ``lopt`` on ``task_family`` with ES workers, a gradient store, a learner and an
    evaluation chief (Metz et al. 2020, App. H.1).

    Args:
      lopt: the :class:`LearnedOptimizer` to train (its meta-parameters are the start, else random).
      task_family: a :class:`TaskFamily` (or one :class:`Task`) the ES workers sample from.
      client: a ``distributed.Client`` (e.g. ``carlskit.connect()``) or ``None`` (threads here).
      directory: run directory: ``checkpoints/``, ``evaluation/`` and ``summaries/`` go under it.
      num_workers: ES worker loops.
      eval_workers: evaluation jobs in flight at most.
      num_tasks, num_steps, std: antithetic pairs per estimate, inner steps per unroll, ES noise.
      estimator, truncation_length, min_num_steps: ``"es"`` (full unrolls of ``num_steps``) or
        ``"pes"``: truncated PES on the workers (:class:`ESWorkerConfig`), ``truncation_length``
        inner steps per estimate within episodes of ``num_steps``, or of lengths log-uniform over
        ``[min_num_steps, num_steps]``.
      aggregation: the meta-objective of an unroll, ``"mean"`` training loss over its steps or the
        ``"last"`` step's (closer to the final loss the evaluation compares).
      max_staleness: gradients older than this many outer steps are dropped (paper: 5).
      outer_optimizer: optax optimizer of the meta-parameters (default ``optax.adam(3e-3)``), or
        ``"self"``: self-training, the learner updates the meta-parameters with the learned optimizer
        they define (:func:`carlskit.lopt.self_optimizer`; pass ``self_optimizer(rule, warmup_steps=...)``
        for an Adam warm-up first).
      checkpoint_every_seconds: learner checkpoint period (paper: 600).
      eval_task_sets: fixed evaluation sets (default :func:`default_eval_task_sets`).
      ood_tasks: out-of-distribution tasks for the default evaluation sets.
      eval_num_steps: inner steps of evaluation runs.
      max_gradients_per_update: records the learner takes per update.
      seed: seeds initial meta-parameters (when ``lopt`` has none) and the workers' streams.
      restart_policy: how every service (learner and store, ES workers, evaluation workers) is
        restarted: a :class:`carlskit.cluster.RestartPolicy` or a budget in seconds (default: keep
        trying for 10 minutes, with exponential backoff up to 15 s apart).
      workers, resources: where every service may run (:class:`carlskit.cluster.Placement`); kept
        when a service is rebuilt. ``placement={"learner": ..., "es_workers": ...,
        "eval_workers": ...}`` places a role on its own (a ``Placement`` or a dict with ``workers``
        and/or ``resources``); the gradient store lives beside the learner. Default: off
        accelerator workers when there are others.
    """

    def __init__(self, lopt: LearnedOptimizer, task_family: TaskFamily | Task, client: Any = None, *,
                 directory: str | os.PathLike, num_workers: int = 2, eval_workers: int = 1, num_tasks: int = 8,
                 num_steps: int = 50, std: float = 0.01, max_staleness: int = 5,
                 outer_optimizer: optax.GradientTransformation | str | None = None,
                 checkpoint_every_seconds: float = 600.0, eval_task_sets: list[EvalTaskSet] | None = None,
                 ood_tasks: tuple[Task, ...] = (), eval_num_steps: int | None = None,
                 max_gradients_per_update: int = 64, put_every: int = 1, seed: int = 0,
                 evaluate: bool = True, summaries: bool = True,
                 restart_policy: RestartPolicy | float | None = None,
                 workers: list[str] | str | None = None, resources: dict[str, float] | None = None,
                 placement: Mapping[str, Placement | Mapping[str, Any]] | None = None,
                 estimator: str = "es", truncation_length: int | None = None,
                 min_num_steps: int | None = None, aggregation: str = "mean") -> None:
        if not isinstance(lopt, LearnedOptimizer):
            raise TypeError(f"lopt must be a LearnedOptimizer, got {type(lopt).__name__}")
        family = as_task_family(task_family)
        outer_optimizer_of(outer_optimizer, lopt.rule)  # checked here; the learner builds its own
        for name, value in (("num_workers", num_workers), ("eval_workers", eval_workers), ("num_tasks", num_tasks),
                            ("num_steps", num_steps), ("max_gradients_per_update", max_gradients_per_update)):
            positive_int(value, name)
        integer(max_staleness, "max_staleness", 0)  # here, not only when start() builds the learner
        positive_float(checkpoint_every_seconds, "checkpoint_every_seconds")
        self.restart_policy = restart_policy_of(restart_policy, "restart_policy")
        self.placement = service_placements(workers, resources, placement)
        if client is None and any(p.restricted for p in self.placement.values()):
            raise ValueError("workers/resources/placement place services on a Dask cluster: pass a client too")
        self.lopt, self.family, self.client = lopt, family, client
        self.directory = pathlib.Path(directory)
        self.checkpoint_path = str(self.directory / "checkpoints")
        self.eval_dir = self.directory / "evaluation"
        self.logdir = str(self.directory / "summaries") if summaries else None
        self.num_workers, self.eval_workers = num_workers, eval_workers
        self.worker_config = ESWorkerConfig(num_tasks, num_steps, std, aggregation, put_every, seed, estimator,
                                            truncation_length, min_num_steps)
        self.learner_options = dict(initial_meta_params=lopt.meta_params, outer_optimizer=outer_optimizer,
                                    max_staleness=max_staleness, max_gradients_per_update=max_gradients_per_update,
                                    checkpoint_every_seconds=checkpoint_every_seconds, logdir=self.logdir,
                                    seed=seed)
        eval_steps = num_steps if eval_num_steps is None else eval_num_steps
        self.eval_task_sets = eval_task_sets if eval_task_sets is not None else default_eval_task_sets(
            family, ood_tasks=tuple(ood_tasks), num_steps=eval_steps)
        self.evaluate = evaluate
        self._init_runtime_state()

    def _init_runtime_state(self) -> None:
        """The services (none yet), all stopped."""
        self.learner_service = LearnerService(self.lopt.rule, self.checkpoint_path, self.learner_options,
                                              self.client, self.placement["learner"], self.restart_policy)
        self.chief: EvaluationChief | None = None
        self.eval_results: dict[int, dict] = {}
        self._errors_reported = 0
        self._tasks: LongRunningTasks | None = None
        self._stop = None
        self._running = False
        self._topic = f"carlskit-meta-training-{uuid.uuid4().hex[:8]}"
        self._widgets: dict[str, Any] = {}
        self._launches: dict[int, int] = {}  # ES worker index -> launches so far (each its own stream)

    # ------------------------------------------------------------------ the learner, as before
    learner = property(lambda self: self.learner_service.learner, doc="The learner (an actor with a client).")
    gradient_store = property(lambda self: self.learner_service.gradient_store, doc="The gradient store.")
    outer_step = property(lambda self: self.learner_service.outer_step,
                          doc="The learner's outer step as the driver last saw it (``None`` before the first).")
    recoveries = property(lambda self: self.learner_service.recoveries,
                          doc="One dict per learner outage (see :class:`LearnerService`).")
    learner_errors = property(lambda self: self.learner_service.errors, doc="The learner's last errors.")
    learner_error_count = property(lambda self: self.learner_service.error_count)
    learner_restarts = property(lambda self: self.learner_service.supervision.restarts)
    learner_gave_up = property(lambda self: self.learner_service.supervision.gave_up,
                               doc="The learner's give-up message, or ``None``.")

    # ------------------------------------------------------------------ ES workers
    def _es_worker_placement(self, index: int) -> list[str] | None:
        """ES worker ``index`` prefers the ``index``-th worker other than the learner's (round robin)."""
        if self.client is None:
            return None
        others = [w for w in self.placement["es_workers"].candidates(self.client) if w != self.learner_service.worker]
        return [others[index % len(others)]] if others else None

    def _worker_args(self, index: int):
        """The arguments of ES worker ``index``, made anew at each (re)launch: the current actors and
        the launch count (each launch draws its own random stream, never its predecessor's)."""

        def make_args() -> tuple:
            launch = self._launches[index] = self._launches.get(index, -1) + 1
            return (index, self.learner, self.gradient_store, self.family, self.lopt.rule, self.worker_config,
                    self._stop, self._topic, self.logdir, None, launch)

        return make_args

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> MetaTraining:
        """Start store, learner, ES workers, the learner's driver and the evaluation chief; returns self."""
        if self._running:
            raise RuntimeError("this MetaTraining is already running; stop() it first")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.learner_service.start()
        self._running = True
        self._stop = stop_flag(self.client, f"{self._topic}-stop")
        if self.evaluate:
            self.chief = EvaluationChief(
                self.lopt.rule, self.checkpoint_path, self.eval_dir, self.eval_task_sets, client=self.client,
                eval_workers=self.eval_workers,
                time_scale=self.worker_config.num_steps / self.eval_task_sets[0].num_steps,
                logdir=self.logdir, on_result=self._on_eval_result, restart_policy=self.restart_policy,
                placement=self.placement["eval_workers"])
            self.eval_results.update(self.chief.results())
        self._tasks = LongRunningTasks(self.client, f"es-worker-{self._topic[-8:]}", piece="worker",
                                       on_poll=self._poll_chief, policy=self.restart_policy,
                                       hold=self.learner_service.down)
        for index in range(self.num_workers):
            self._tasks.launch(str(index), run_es_worker, self._worker_args(index),
                               workers=self._es_worker_placement(index), placement=self.placement["es_workers"])
        return self

    def _poll_chief(self) -> None:
        if self.chief is not None:
            self.chief.poll()

    def _on_eval_result(self, version: int, curves: dict) -> None:
        self.eval_results[version] = curves
        widget = self._widgets.get("eval_curves")
        if widget is not None:
            widget.add({version: curves})

    def stop(self, timeout: float = 60.0, *, evaluate_final: bool = True) -> None:
        """Stop the workers and the driver, checkpoint the learner's latest meta-parameters, evaluate
        that final checkpoint (``evaluate_final``, waiting up to ``timeout``), and stop the chief.
        Checkpoints not evaluated yet are left for the next chief over the same directory."""
        if not self._running:
            return
        try:
            if self._tasks is not None:
                self._tasks.stop(self._stop, timeout)
        finally:
            self.learner_service.stop(timeout)
            self._running = False
            try:
                self.learner_service.close(timeout)
            finally:
                self._stop_chief(timeout, evaluate_final)
        for widget in self._widgets.values():  # a last refresh showing the final state, then stop
            for method in ("update", "refresh", "stop"):
                if hasattr(widget, method):
                    with contextlib.suppress(Exception):
                        getattr(widget, method)()
        if getattr(self, "_dashboard", None) is not None:  # the saved output shows that final state
            self._dashboard.show_final_frame()

    def _stop_chief(self, timeout: float, evaluate_final: bool) -> None:
        """Evaluate the final checkpoint and close the chief, whatever the evaluation raised."""
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

    def check(self) -> None:
        """Raise :class:`carlskit.ServiceGaveUpError` if any service (learner and store, an ES worker,
        the evaluation workers) was given up, and ``RuntimeError`` if the driver itself failed."""
        reasons = [self.learner_gave_up] if self.learner_gave_up else []
        if self._tasks is not None:
            reasons += list(self._tasks.gave_up.values())
        if self.chief is not None and self.chief.gave_up:
            reasons.append(self.chief.gave_up)
        if reasons:
            raise ServiceGaveUpError("; ".join(reasons))
        error = self.learner_service.driver_error
        if error is not None:
            raise RuntimeError(f"the meta-training driver failed: {error!r}") from error

    def wait(self, outer_step: int | None = None, timeout: float | None = None, *,
             poll_seconds: float = 0.1) -> int | None:
        """Block until the learner has reached ``outer_step`` (``None``: until :meth:`stop`, e.g. from
        another thread or a keyboard interrupt); returns the outer step reached.

        Raises :class:`carlskit.ServiceGaveUpError` as soon as any service gave up (its restart
        budget spent), ``RuntimeError`` if the driver failed, ``TimeoutError`` after ``timeout``
        seconds. Errors the services recovered from (a lost worker, a failed round) are not raised:
        a ``RuntimeWarning`` says how many there were since the last call, and :meth:`status` has them.
        """
        if outer_step is not None:
            outer_step = integer(outer_step, "outer_step", 0)
        if timeout is not None:
            timeout = positive_float(timeout, "timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                self.check()
                if not self._running or (outer_step is not None and (self.outer_step or 0) >= outer_step):
                    return self.outer_step
                if deadline is not None and time.monotonic() > deadline:
                    states = {name: row["state"] for name, row in self.services().items()}
                    raise TimeoutError(f"outer step {outer_step} not reached within {timeout:g} s "
                                       f"(at {self.outer_step}; services: {states})")
                time.sleep(poll_seconds)
        finally:
            self._warn_recovered_errors()

    def _warn_recovered_errors(self) -> None:
        errors = self.learner_error_count + (self._tasks.error_count if self._tasks is not None else 0)
        new, self._errors_reported = errors - self._errors_reported, errors
        if new > 0:
            import warnings

            warnings.warn(f"meta-training recovered from {new} background error(s) since the last wait(); "
                          f"see status()['services'], learner_errors and the ES workers' errors",
                          RuntimeWarning, stacklevel=3)

    def services(self) -> dict[str, ServiceStatus]:
        """Supervision state per service (a :class:`carlskit.cluster.ServiceStatus` each): ``state``
        (running, restarting, waiting, gave up, stopped), ``failures`` in the current streak,
        ``budget_left_seconds`` and the last ``reason``."""
        report = {"learner": self.learner_service.row()}
        if self._tasks is not None:
            report.update({f"es worker {key}": row for key, row in self._tasks.status().items()})
        if self.chief is not None:
            report["evaluation"] = self.chief.supervision()
        return report

    # ------------------------------------------------------------------ results
    def learner_status(self) -> dict[str, Any]:
        """The learner's figures (outer step, gradients/s, staleness histogram, dropped fraction...)."""
        return self.learner_service.status()

    def status(self) -> dict[str, Any]:
        """One dict for ``ClusterStatus``: the services' supervision state (``services``), learner,
        store, workers, restarts, outages (``recoveries``), errors, evaluation, task families."""
        report, tasks = self.learner_service.report(), self._tasks
        report.update(es_workers=self.num_workers, services=self.services(),
                      es_workers_running=0 if tasks is None else len(tasks.running()),
                      worker_restarts=0 if tasks is None else tasks.restarts,
                      worker_errors=0 if tasks is None else tasks.error_count)
        if self.chief is not None:
            report["evaluation"] = self.chief.status()
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
        """A :class:`LearnedOptimizer` with the meta-parameters of checkpoint ``version`` (default: the
        newest intact one; damaged newer ones are skipped and logged)."""
        store = self.checkpoints()
        if version is None:
            found = load_newest_intact(store, lambda v: load_meta_params_checkpoint(store, self.lopt.rule, v))
            if found is None:
                raise FileNotFoundError(f"no checkpoint in {self.checkpoint_path!r}")
            meta_params, metadata = found[1]
        else:
            meta_params, metadata = load_meta_params_checkpoint(store, self.lopt.rule, version)
        info = {**self.lopt.info, "checkpoint": metadata["version"], "outer_step": metadata.get("outer_step")}
        return LearnedOptimizer(self.lopt.rule, meta_params, self.worker_config.num_steps, info)

    # ------------------------------------------------------------------ display
    def dashboard(self, every_seconds: float = 1.0):
        """Live view: outer loss, gradients/s and dropped fraction (``LiveSummaries``), the staleness
        histogram, the evaluation curves per checkpoint (``EvalCurves``) and the cluster status."""
        from carlskit.widgets import ClusterStatus, EvalCurves, LiveSummaries, Panels, StalenessHistogram

        if self.logdir is None:
            raise ValueError("dashboard needs summaries=True")
        live = LiveSummaries(self.logdir, ["learner/outer_loss", "learner/gradients_per_second",
                                           "learner/dropped_fraction"], every_seconds=every_seconds)
        curves = EvalCurves({v: c for v, c in sorted(self.eval_results.items())})
        board = ClusterStatus(self.client, sources=[self], every_seconds=every_seconds, show_devices=False)
        staleness = StalenessHistogram(self.learner_status, self.learner_options["max_staleness"],
                                       every_seconds=every_seconds)
        self._widgets.update(live=live, eval_curves=curves, status=board, staleness=staleness)
        if self._running:  # refresh while training runs, displayed or not
            live.start()
            board.start()
        self._dashboard = Panels([live, staleness, curves, board])
        return self._dashboard

    def _repr_html_(self) -> str:
        status = self.status()
        rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                       for k, v in status.items() if k != "families")
        return f"<b>MetaTraining</b> {html.escape(str(self.directory))}<table>{rows}</table>"

    def __repr__(self) -> str:
        state = "running" if self._running else "stopped"
        return (f"<MetaTraining {state}: {self.num_workers} ES workers, {self.eval_workers} eval workers, "
                f"outer step {self.learner_service.last_status.get('outer_step')}>")
