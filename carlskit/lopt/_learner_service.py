"""The learner and its gradient store as one supervised service of :class:`MetaTraining`.

With a Dask client the store and the learner are two actors on one worker (each an
:class:`carlskit.cluster.ActorHost`, the learner pinned beside its store); without one, objects of
this process. A driver thread calls ``learner.update()`` in a loop. When the learner's worker is
lost (decided by type, :func:`carlskit.cluster.is_worker_loss`, or by the actors' state,
:meth:`ActorHost.lost`), the driver rebuilds both on a live worker of the placement, under the
service's :class:`carlskit.cluster.ServiceState`: a failed rebuild (no worker yet, checkpoints
unreadable) is retried after its backoff delay until the budget is spent, then the learner is
given up. The new learner resumes from the newest intact checkpoint, so the outer steps since
that checkpoint are lost (at most ``checkpoint_every_seconds`` of progress) and re-done;
:attr:`LearnerService.recoveries` records each outage.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from typing import Any

from carlskit.cluster import (
    MAX_KEPT_ERRORS,
    ActorHost,
    Placement,
    RestartPolicy,
    ServiceState,
    ServiceStatus,
    is_worker_loss,
)
from carlskit.lopt._gradient_store import GradientStore, call
from carlskit.lopt._learner import Learner
from carlskit.lopt._protocols import UpdateRule

logger = logging.getLogger("carlskit.lopt.meta_training")
UPDATE_TIMEOUT_SECONDS = 60.0
STATUS_TIMEOUT_SECONDS = 10.0  # status() is polled by widgets: never blocks them for long


class LearnerService:
    """Store and learner, their driver thread and their supervision (see the module docstring).

    Args:
      rule: the learned optimizer's update rule.
      checkpoint_path: the learner's checkpoint directory (it resumes from the newest intact one).
      learner_options: keyword arguments of :class:`Learner`.
      client: a ``distributed.Client`` or ``None`` (objects of this process).
      placement: where the pair may run.
      policy: the :class:`RestartPolicy` of its rebuilds.
    """

    def __init__(self, rule: UpdateRule, checkpoint_path: str, learner_options: dict, client: Any,
                 placement: Placement, policy: RestartPolicy) -> None:
        self.rule, self.checkpoint_path, self.learner_options = rule, checkpoint_path, learner_options
        self.client, self.placement = client, placement
        self.supervision = ServiceState("meta-training", "the learner", policy, placement=placement)
        self.store_host = ActorHost(client, placement, "gradient-store") if client is not None else None
        self.learner_host = ActorHost(client, placement, "learner") if client is not None else None
        self.learner: Any = None
        self.gradient_store: Any = None
        self.errors: collections.deque[str] = collections.deque(maxlen=MAX_KEPT_ERRORS)  # the last ones
        self.error_count = 0
        #: the learner's outer step as the driver last saw it (``None`` before the first update).
        self.outer_step: int | None = None
        #: one dict per outage: ``outer_step_before``, ``resumed_from``, ``outer_steps_lost``,
        #: ``seconds`` (loss noticed -> learner rebuilt), ``attempts`` (rebuilds tried).
        self.recoveries: list[dict[str, Any]] = []
        self.driver_error: BaseException | None = None
        self.last_status: dict = {}
        self._outage: dict[str, Any] | None = None
        self._halt = threading.Event()
        self._driving = threading.Event()
        self._driver: threading.Thread | None = None

    # ------------------------------------------------------------------ the actors
    @property
    def worker(self) -> str | None:
        """Where the actors are (``None`` embedded or before the first start)."""
        return None if self.learner_host is None else self.learner_host.worker

    def build(self) -> None:
        """Create the store and the learner (resuming from the latest checkpoint), releasing old ones."""
        if self.client is None:
            store = GradientStore()
            self.learner, self.gradient_store = Learner(self.rule, store, self.checkpoint_path,
                                                        **self.learner_options), store
            return
        store = self.store_host.start(GradientStore, exclude=[] if self.worker is None else [self.worker])
        learner = self.learner_host.start(Learner, self.rule, store, self.checkpoint_path,
                                          worker=self.store_host.worker, **self.learner_options)
        self.learner, self.gradient_store = learner, store

    def lost(self) -> bool:
        """Are the learner's or store's actors gone? By their futures' state and the worker list."""
        return self.client is not None and (self.store_host.lost() or self.learner_host.lost())

    def down(self) -> str | None:
        """Why ES workers must wait for the learner, or ``None`` when it is up (their ``hold``)."""
        state = self.supervision.state
        if state == "gave up" or self._outage is not None:  # its own errors keep it "up": it is retried
            return f"the learner ({state}: {self.supervision.reason})"
        if state in ("running", "restarting") and self.lost():
            return "the learner (its worker was lost)"
        return None

    # ------------------------------------------------------------------ the driver
    def start(self) -> None:
        """Build the pair and start the driver thread."""
        self.build()
        self.supervision.start()
        self._halt.clear()
        self.driver_error = None
        self._driving.set()
        self._driver = threading.Thread(target=self._drive_learner, name="meta-training-learner", daemon=True)
        self._driver.start()

    @property
    def driving(self) -> bool:
        return self._driver is not None

    def stop(self, timeout: float) -> None:
        """Stop the driver (the actors stay until :meth:`close`)."""
        self._driving.clear()
        self._halt.set()
        if self._driver is not None:
            self._driver.join(timeout)
        self._driver = None
        self.supervision.stop()

    def close(self, timeout: float) -> None:
        """A last status and checkpoint of the learner, then release the actors (errors recorded)."""
        try:
            self.supervision.check()
            self.last_status = call(self.learner, "status", timeout=timeout)
            call(self.learner, "close", timeout=timeout)
        except Exception as error:  # its worker may be gone; the checkpoints on disk remain
            self.record_error(f"close failed: {error!r}")
        finally:
            for host in (self.learner_host, self.store_host):
                if host is not None:
                    host.release()

    def _drive_learner(self) -> None:
        try:
            self._drive()
        except BaseException as error:  # a bug of the driver itself: never silent, raised by wait()
            self.driver_error = error
            self.record_error(f"driver failed: {type(error).__name__}: {error}\n{traceback.format_exc()}")
            logger.exception("meta-training driver failed")

    def _drive(self) -> None:
        """Update the learner in a loop; rebuild it (with backoff, within the budget) when it is lost."""
        while self._driving.is_set():
            if self.supervision.state == "restarting" and self._outage is not None:
                if not self._rebuild():
                    return
                continue
            try:
                result = call(self.learner, "update", timeout=UPDATE_TIMEOUT_SECONDS)
            except Exception as error:
                if not self._driving.is_set() or (self.client is not None and self.client.status != "running"):
                    return
                # Lost (decided by type, or by the actors' state): rebuild. Any other error is the
                # learner's own: the same learner is asked again after the backoff delay; if the
                # actors turn out lost by then (their state lags the first error), they are rebuilt.
                if is_worker_loss(error) or self.lost():
                    self._outage = {"outer_step_before": self.outer_step, "started": time.monotonic(), "attempts": 0}
                    logger.warning("learner lost (%s: %s): rebuilding it from its latest checkpoint",
                                   type(error).__name__, error)
                if not self._failed(error, "update"):
                    return
                continue
            self.supervision.recovered()
            self.outer_step = int(result["outer_step"])
            if not result["taken"]:
                time.sleep(0.01)

    def _rebuild(self) -> bool:
        """One try at rebuilding store and learner; returns False when the driver must end."""
        outage = self._outage
        outage["attempts"] += 1
        try:
            self.build()
            resumed_from = call(self.learner, "status", timeout=UPDATE_TIMEOUT_SECONDS)["resumed_from"]
        except Exception as error:  # no worker yet, checkpoints unreadable, the new worker lost too...
            if not self._driving.is_set():
                return False
            return self._failed(error, "rebuild")
        before = outage["outer_step_before"]
        record = {"outer_step_before": before, "resumed_from": resumed_from,
                  "outer_steps_lost": None if before is None or resumed_from is None else before - resumed_from,
                  "seconds": round(time.monotonic() - outage["started"], 3), "attempts": outage["attempts"]}
        self.recoveries.append(record)
        self._outage = None
        self.supervision.recovered(restarted=True)
        logger.warning("learner rebuilt from checkpoint %s after %.1f s", resumed_from, record["seconds"])
        return True

    def _failed(self, error: BaseException, where: str) -> bool:
        """Record a failure of the learner and wait its backoff delay; False once its budget is spent."""
        self.record_error(f"{where}: {type(error).__name__}: {error}\n{traceback.format_exc()}")
        logger.error("learner %s failed: %r", where, error)
        prefix = "rebuild failed: " if where == "rebuild" else ""
        delay = self.supervision.failed(f"{where}: {type(error).__name__}: {error}")
        if delay is None:
            return False
        self.supervision.reason = f"{prefix}{type(error).__name__}: {error}"
        self._halt.wait(delay)
        return self._driving.is_set()

    def record_error(self, message: str) -> None:
        self.errors.append(message)
        self.error_count += 1

    # ------------------------------------------------------------------ reports
    def row(self) -> ServiceStatus:
        """The learner's :class:`carlskit.cluster.ServiceStatus` (with its ``restarts``)."""
        return self.supervision.status(self.worker, restarts=self.supervision.restarts)

    def status(self) -> dict[str, Any]:
        """The learner's figures (outer step, gradients/s, staleness histogram, dropped fraction...);
        the last ones, and why, while it is down or unanswering."""
        if self._driver is None:
            return dict(self.last_status)
        down = self.down()
        if down is not None:  # no call on actors known to be gone
            return {**self.last_status, "error": f"waiting for {down}"}
        try:
            self.last_status = call(self.learner, "status", timeout=STATUS_TIMEOUT_SECONDS)
        except Exception as error:
            return {**self.last_status, "error": repr(error)}
        return dict(self.last_status)

    def report(self) -> dict[str, Any]:
        """The learner's part of ``MetaTraining.status()``: its figures, the store's, its restarts and
        outages (``recoveries``), and each task family's monitoring (``families``)."""
        learner = self.status()
        report = {key: learner.get(key) for key in ("outer_step", "resumed_from", "outer_loss",
                                                    "gradients_per_second", "dropped_fraction", "received",
                                                    "applied", "rejected", "latest_checkpoint",
                                                    "mean_update_seconds", "staleness_counts")}
        report["store"] = self.store_status()
        report["learner_restarts"] = self.supervision.restarts
        report["recoveries"] = [dict(r) for r in self.recoveries]
        monitored = {row["task_family"]: row for row in learner.get("families") or []}
        report["families"] = [{**monitored.get(name, {}), "task_family": name, **values}
                              for name, values in (learner.get("family_losses") or {}).items()]
        return report

    def store_status(self) -> Any:
        try:
            if self._driver is not None and self.down() is not None:
                return "down with the learner"
            return call(self.gradient_store, "status", timeout=STATUS_TIMEOUT_SECONDS) if self.gradient_store \
                else None
        except Exception as error:
            return repr(error)
