"""The supervision layer: long-running work and actor services that survive lost workers.

Every long-running piece carlskit puts on a cluster (maker slices, ES workers, evaluation workers,
the learner, summary aggregators, bank shards) is restarted under one rule, :class:`RestartPolicy`:
exponential backoff with jitter, and a budget in *seconds* (keep trying for ``budget_seconds`` after
the failures began), not a count that a fast failure loop spends in seconds. A piece that has run
for ``healthy_after_seconds`` without failing starts a new budget. :class:`Backoff` holds one piece's
failure streak; actor services (the learner, aggregators, bank shards) use it directly;
:class:`LongRunningTasks` uses it for functions that loop until a stop flag is set.

:class:`LongRunningTasks` runs each piece, with a Dask client, as a task that secedes from its
worker's thread pool (so it never blocks other tasks or actors); without one, in a daemon thread of
this process. What a piece needs travels with its task: ``make_args()`` is called again for every
launch (so it picks up, e.g., actors rebuilt after a lost worker), and nothing is ``scatter``-ed
(scattered data dies with its worker and cannot be recomputed). A supervisor thread polls the pieces:
one that raised, was cancelled, or ended unasked counts as a failure with its reason (kept in
``errors``, the last ``MAX_KEPT_ERRORS``; ``error_count`` counts all; logged and printed once) and is
relaunched after its backoff delay. When a piece's budget is spent it is given up: its state in
:meth:`LongRunningTasks.status` says ``"gave up"`` with the reason, and :meth:`LongRunningTasks.check`
raises :class:`carlskit.ServiceGaveUpError` in the owner's process (``Maker.wait_for_version``,
``Trainer.fit`` with makers, ``MetaTraining.wait``).

Pieces that depend on another service (ES workers on the learner) pass ``hold``: while it names a
reason (the service is known to be down), a piece that ends is *waiting*, not failed: it is not
counted against its budget and not relaunched (relaunching against a dead service only burns the
budget), and every waiting piece is relaunched as soon as ``hold`` returns ``None``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from carlskit._errors import ServiceGaveUpError
from carlskit.cluster._loss import is_worker_loss
from carlskit.cluster._placement import NoWorkerError, Placement, live_workers
from carlskit.cluster._policy import Backoff, RestartPolicy, restart_policy  # noqa: F401 - importable from here too
from carlskit.cluster._status import ServiceState, ServiceStatus

logger = logging.getLogger("carlskit.cluster")
#: Errors a service keeps (the last ones; ``error_count`` counts all), so a crash loop cannot fill memory.
MAX_KEPT_ERRORS = 100


def secede_if_on_worker() -> None:
    """Free the Dask worker's thread slot for a task that runs for as long as training does."""
    from distributed import secede

    with contextlib.suppress(ValueError, KeyError):
        secede()


def log_worker_event(topic: str, message: dict) -> bool:
    """Log ``message`` as a Dask event under ``topic`` when called on a worker (clients subscribe
    with ``Client.subscribe_topic``); returns False, logging nothing, anywhere else."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:  # not on a worker (embedded threads, the client)
        return False
    worker.log_event(topic, message)
    return True


class ThreadStopFlag:
    """``threading.Event`` with ``distributed.Event``'s ``is_set``/``set``/``clear`` (embedded mode)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event.clear()


def stop_flag(client: Any, name: str) -> Any:
    """A cleared stop flag visible to every worker (``distributed.Event``) or a local one."""
    if client is None:
        return ThreadStopFlag()
    from distributed import Event

    flag = Event(name, client=client)
    flag.clear()
    return flag


class PieceEndedError(RuntimeError):
    """A long-running piece returned although nobody asked it to stop."""


class LongRunningTasks:
    """Launch named long-running functions and keep them running until :meth:`stop`.

    Args:
      client: a ``distributed.Client`` (Dask tasks) or ``None`` (threads of this process).
      name: prefix of task keys and thread names.
      piece: what one piece is called in messages (``"slice"``, ``"worker"``).
      poll_seconds: how often the supervisor checks the running pieces.
      policy: the :class:`RestartPolicy` (or a budget in seconds) each piece is restarted under.
      on_poll: called by the supervisor thread once per poll (e.g. to check the health of actors
        before the pieces are relaunched); its exceptions are logged and kept like a piece's, and
        never keep the pieces from being relaunched.
      on_give_up: called with ``(key, reason)`` when a piece is given up.
      hold: called once per poll; a reason (str) while a service the pieces need is down: pieces
        ending then wait for it (state ``"waiting"``, no failure counted, no relaunch) and are
        relaunched when it returns ``None``. Its exceptions are recorded and count as no hold.
    """

    def __init__(self, client: Any, name: str, *, piece: str = "piece", poll_seconds: float = 0.2,
                 policy: RestartPolicy | float | None = None, on_poll: Callable[[], None] | None = None,
                 on_give_up: Callable[[str, str], None] | None = None,
                 hold: Callable[[], str | None] | None = None) -> None:
        self.client, self.name, self.piece = client, name, piece
        self.poll_seconds, self.on_poll, self.on_give_up, self.hold = poll_seconds, on_poll, on_give_up, hold
        self.policy = restart_policy(policy, "policy")
        #: ``(where, message with traceback)`` of the last ``MAX_KEPT_ERRORS`` errors, oldest first.
        self.errors: list[tuple[str, str]] = []
        self.error_count = 0  # every error recorded, including those no longer kept
        self.restarts = 0
        self.worker_losses = 0  # failures that were a lost worker or a cancelled task
        self.held_endings = 0  # pieces that ended while ``hold`` said a service they need was down
        self._held: set[str] = set()  # keys waiting for that service (no failure counted)
        self._hold_reason: str | None = None
        #: ``{key: reason}`` of the pieces given up after their restart budget was spent.
        self.gave_up: dict[str, str] = {}
        self._last_message: dict[str, str] = {}
        self._specs: dict[str, tuple[Callable, Callable[[], tuple], dict]] = {}
        self._running: dict[str, Any] = {}
        self._started_at: dict[str, float] = {}
        self._waiting: dict[str, str] = {}  # key -> reason, relaunched when its backoff allows
        self._service: dict[str, ServiceState] = {}  # key -> its state machine (backoff, give-up message)
        self._allowed: dict[str, set[str]] = {}  # key -> the worker addresses its placement resolved to
        self._live: set[str] | None = None
        self._stopping = False
        self._lock = threading.RLock()
        self._supervisor: threading.Thread | None = None

    def launch(self, key: str, fn: Callable, make_args: Callable[[], tuple], *,
               workers: list[str] | None = None, placement: Placement | None = None) -> None:
        """Run ``fn(*make_args())`` as piece ``key`` (replacing a finished piece of that key).

        ``placement`` (a :class:`carlskit.cluster.Placement`) restricts the piece to the live workers
        it matches, resolved again at every relaunch (a restarted piece keeps its placement; when
        none of its workers is alive it is relaunched among those that are). Without one, pieces
        stay off accelerator workers when there are others. ``workers`` are preferred, not required.
        """
        with self._lock:
            placement = placement or Placement()
            self._specs[key] = (fn, make_args, {"workers": workers, "placement": placement})
            service = self._service[key] = ServiceState(self.name, f"{self.piece} {key}", self.policy,
                                                        placement=placement)
            service.start()
            self.gave_up.pop(key, None)
            try:
                self._start(key)
            except NoWorkerError as error:  # its workers are not up yet: retried like any failure
                self.record_error(f"{self.piece} {key} launch", error)
                service.failed(error)
                self._waiting[key] = f"{type(error).__name__}: {error}"
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name=f"{self.name}-supervisor", daemon=True)
            self._supervisor.start()

    def _start(self, key: str) -> None:
        fn, make_args, options = self._specs[key]
        if self.client is not None:  # resolve the placement first: no arguments built for nothing
            preferred, placement = options["workers"], options["placement"]
            allowed = placement.candidates(self.client)
            if not allowed:
                raise NoWorkerError(f"no live worker matches {self.piece} {key}'s placement ({placement})")
            everyone = set(self._live_workers(refresh=True))
            if placement.restricted or set(allowed) != everyone:
                restriction = dict(workers=allowed, allow_other_workers=False)
                self._allowed[key] = set(allowed)
            else:
                restriction = dict(workers=preferred, allow_other_workers=bool(preferred))
                self._allowed.pop(key, None)
        arguments = make_args()
        self._waiting.pop(key, None)
        self._service[key].resumed()
        self._started_at[key] = time.monotonic()
        if self.client is None:
            outcome: dict = {}

            def run() -> None:
                try:
                    outcome["value"] = fn(*arguments)
                except BaseException as error:
                    outcome["error"], outcome["traceback"] = error, traceback.format_exc()

            thread = threading.Thread(target=run, name=f"{self.name}-{key}", daemon=True)
            thread.start()
            self._running[key] = (thread, outcome)
        else:
            import dask

            # A piece's function and data travel inside its task on purpose (a scattered copy would die
            # with its worker, and Dask could not rerun the piece elsewhere): a maker's features are often
            # tens of MB, so Dask's warning about large graphs would fire on every start and restart.
            with dask.config.set({"distributed.admin.large-graph-warning-threshold": "1GiB"}):
                self._running[key] = self.client.submit(
                    fn, *arguments, pure=False, **restriction, key=f"{self.name}-{key}-{uuid.uuid4().hex[:8]}")

    def _live_workers(self, refresh: bool = False) -> set[str]:
        """Addresses of the scheduler's workers, fetched at most once per poll."""
        if refresh or self._live is None:
            self._live = set(live_workers(self.client))
        return self._live

    def _finished(self, key: str) -> tuple[bool, BaseException | None, str]:
        """``(done, error, traceback)``; a piece that ended unasked or was cancelled has an error."""
        running = self._running[key]
        if self.client is None:
            thread, outcome = running
            if thread.is_alive():
                return False, None, ""
            error = outcome.get("error")
            if error is None and not self._stopping:
                error = PieceEndedError(f"{self.piece} {key} returned {outcome.get('value')!r} without being stopped")
            return True, error, outcome.get("traceback", "")
        if not running.done():
            allowed = self._allowed.get(key)
            if allowed is not None and not allowed & self._live_workers():
                # Dask would wait for one of these workers forever: place it again among the live ones.
                running.cancel()
                return True, NoWorkerError(f"every worker {self.piece} {key} was placed on is gone"), ""
            return False, None, ""
        if running.status == "cancelled":  # exception() of a cancelled future is None: say why
            from distributed.client import FutureCancelledError

            return True, FutureCancelledError(running.key, "its worker or its inputs were lost"), ""
        if running.status == "error":
            try:
                error = running.exception(timeout=5)
                trace = "".join(traceback.format_tb(running.traceback(timeout=5)))
            except Exception as lost:  # the future was released under us
                error, trace = lost, ""
            return True, error, trace
        if self._stopping:
            return True, None, ""
        return True, PieceEndedError(f"{self.piece} {key} returned without being stopped"), ""

    def record_error(self, where: str, error: BaseException, trace: str = "") -> None:
        """Keep, log and print an error (of a piece, or of the supervision step): never swallowed.

        Only the last ``MAX_KEPT_ERRORS`` are kept (``error_count`` counts all); an error repeating
        the previous one of the same ``where`` (e.g. every poll) is kept and counted, printed once."""
        message = f"{self.name} {where} raised {type(error).__name__}: {error}"
        with self._lock:
            self.errors.append((where, f"{message}\n{trace}"))
            del self.errors[:-MAX_KEPT_ERRORS]
            self.error_count += 1
            if self._last_message.get(where) == message:
                logger.debug("%s (again)", message)
                return
            self._last_message[where] = message
        logger.error(message)
        print(message, file=sys.stderr, flush=True)

    def _failed(self, key: str, reason: str) -> bool:
        """Count a failure of piece ``key`` (its :class:`ServiceState`); give it up once its budget is
        spent (the state logged and printed the one give-up message). Whether it will be relaunched."""
        if self._service[key].failed(reason) is not None:
            self._waiting[key] = reason
            return True
        message = self.gave_up[key] = self._service[key].gave_up
        self._running.pop(key, None)
        self._waiting.pop(key, None)
        if self.on_give_up is not None:
            try:
                self.on_give_up(key, message)
            except Exception as error:
                self.record_error("on_give_up", error, traceback.format_exc())

    def poll_once(self) -> list[str]:
        """Record pieces that ended, relaunch those whose backoff has passed; returns relaunched keys."""
        relaunched = []
        held = self._check_hold()
        with self._lock:
            if self._stopping:
                return relaunched
            self._live = None  # the workers alive now, fetched on first use in this poll
            self._hold_reason = held
            now = time.monotonic()
            for key in list(self._running):
                done, error, trace = self._finished(key)
                service = self._service[key]
                if not done:
                    if service.backoff.failures and now - self._started_at[key] >= self.policy.healthy_after_seconds:
                        service.recovered()  # ran long enough: a new streak (and budget) next time
                    continue
                del self._running[key]
                error = error if error is not None else PieceEndedError(f"{self.piece} {key} ended")
                self.worker_losses += is_worker_loss(error)
                self.record_error(f"{self.piece} {key}", error, trace)
                reason = f"{type(error).__name__}: {error}"
                if held is not None:  # the service it needs is down: its failure, not this piece's
                    self.held_endings += 1
                    self._held.add(key)
                    self._waiting[key] = reason
                    service.wait(f"waiting for {held}; ended with {reason}")
                else:
                    self._failed(key, reason)
            for key in list(self._waiting):
                if held is not None:
                    continue  # relaunched once the service is back, not against a dead one
                if key in self._held or self._service[key].ready():
                    self._held.discard(key)
                    self.restarts += 1
                    try:
                        self._start(key)
                    except Exception as error:  # e.g. make_args() needs a service that is still down
                        self.record_error(f"{self.piece} {key} relaunch", error, traceback.format_exc())
                        self._failed(key, f"{type(error).__name__}: {error}")
                        continue
                    relaunched.append(key)
        return relaunched

    def _check_hold(self) -> str | None:
        if self.hold is None:
            return None
        try:
            reason = self.hold()
        except Exception as error:
            self.record_error("hold", error, traceback.format_exc())
            return None
        return None if reason is None else str(reason)

    def _supervise(self) -> None:
        # on_poll and poll_once each in their own try: a failing on_poll never stops relaunches.
        steps = [("on_poll", self.on_poll)] if self.on_poll is not None else []
        steps.append(("supervisor", self.poll_once))
        while not self._stopping:
            for where, step in steps:
                try:
                    step()
                except Exception as error:  # e.g. the client closed under us: say why, keep going until stop
                    if self._stopping or (self.client is not None and self.client.status != "running"):
                        return
                    self.record_error(where, error, traceback.format_exc())
            time.sleep(self.poll_seconds)

    def running(self) -> list[str]:
        with self._lock:
            return [key for key in self._running if not self._finished(key)[0]]

    def check(self) -> None:
        """Raise :class:`carlskit.ServiceGaveUpError` if any piece was given up."""
        if self.gave_up:
            raise ServiceGaveUpError("; ".join(self.gave_up.values()))

    def status(self) -> dict[str, ServiceStatus]:
        """Per piece, its :class:`~carlskit.cluster.ServiceStatus`: ``state`` (running, restarting,
        waiting (for a service ``hold`` names), gave up,
        stopped), failures in its streak, seconds of restart budget left, the last reason it failed,
        its placement, and the worker running it (with a client)."""
        where: dict[str, str] = {}
        if self.client is not None:
            try:
                for address, keys in self.client.processing().items():
                    where.update({task_key: address for task_key in keys})
            except Exception:  # the scheduler is gone: the states below still say what we know
                pass
        with self._lock:
            report = {}
            for key in self._specs:
                if key in self.gave_up:
                    state, reason = "gave up", self.gave_up[key]
                elif key in self._waiting and (key in self._held or self._hold_reason is not None):
                    state, reason = "waiting", (f"waiting for {self._hold_reason or 'a service'}; "
                                                f"ended with {self._waiting[key]}")
                elif key in self._waiting:
                    state, reason = "restarting", self._waiting[key]
                elif key in self._running:
                    state, reason = "running", None
                else:
                    state, reason = "stopped", None
                running = self._running.get(key)
                worker = where.get(getattr(running, "key", None)) if self.client is not None else "this process"
                report[key] = dataclasses.replace(self._service[key].status(worker), state=state, reason=reason)
            return report

    def stop(self, stop_flag: Any, timeout: float = 30.0) -> None:
        """Set ``stop_flag`` (the flag the pieces watch) and wait for every piece to end."""
        self._stopping = True
        stop_flag.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout)
        deadline = time.monotonic() + timeout
        with self._lock:
            running = list(self._running.values())
            self._running.clear()
            self._waiting.clear()
        for piece in running:
            remaining = max(deadline - time.monotonic(), 0.1)
            if self.client is None:
                piece[0].join(remaining)
            else:
                with contextlib.suppress(Exception):  # errors were recorded by the supervisor
                    piece.result(timeout=remaining)
        self._supervisor = None
