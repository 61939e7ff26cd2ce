"""Long-running work on Dask workers (or threads here) with a supervisor that restarts what fails.

Shared by :class:`carlskit.makers.Maker` (its slices) and :class:`carlskit.lopt.MetaTraining` (its
ES workers): each piece of work is a function that loops until a stop flag is set. With a Dask client it runs as a task that
secedes from its worker's thread pool (so it never blocks other tasks or actors); without one, in a
daemon thread of this process. A supervisor thread polls them: a piece that raised, or whose
worker died, is relaunched with *fresh* arguments (``make_args()`` is called again, so it picks up,
e.g., actors rebuilt after a lost worker); its error is kept in ``errors`` (the last
``MAX_KEPT_ERRORS``; ``error_count`` counts them all) and logged.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("carlskit.cluster")
MAX_KEPT_ERRORS = 100


def secede_if_on_worker() -> None:
    """Free the Dask worker's thread slot for a task that runs for as long as training does."""
    from distributed import secede

    with contextlib.suppress(ValueError, KeyError):
        secede()


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


class LongRunningTasks:
    """Launch named long-running functions and keep them running until :meth:`stop`.

    Args:
      client: a ``distributed.Client`` (Dask tasks) or ``None`` (threads of this process).
      name: prefix of task keys and thread names.
      piece: what one piece is called in error messages (``"slice"``, ``"worker"``).
      poll_seconds: how often the supervisor checks the running pieces.
      max_restarts: restarts in total after which failing pieces are given up (logged).
      on_poll: called by the supervisor thread once per poll (e.g. to check the health of actors
        before the pieces are relaunched); its exceptions are logged and kept like a piece's, and
        never keep the pieces from being relaunched.
    """

    def __init__(self, client: Any, name: str, *, piece: str = "piece", poll_seconds: float = 0.2,
                 max_restarts: int = 100, on_poll: Callable[[], None] | None = None) -> None:
        self.client, self.name, self.piece = client, name, piece
        self.poll_seconds, self.max_restarts, self.on_poll = poll_seconds, max_restarts, on_poll
        #: ``(where, message with traceback)`` of the last ``MAX_KEPT_ERRORS`` errors, oldest first.
        self.errors: list[tuple[str, str]] = []
        self.error_count = 0  # every error recorded, including those no longer kept
        self.restarts = 0
        self._last_message: dict[str, str] = {}
        self._specs: dict[str, tuple[Callable, Callable[[], tuple], dict]] = {}
        self._running: dict[str, Any] = {}
        self._stopping = False
        self._lock = threading.Lock()
        self._supervisor: threading.Thread | None = None

    def launch(self, key: str, fn: Callable, make_args: Callable[[], tuple], *,
               workers: list[str] | None = None) -> None:
        """Run ``fn(*make_args())`` as piece ``key`` (replacing a finished piece of that key)."""
        with self._lock:
            self._specs[key] = (fn, make_args, {"workers": workers})
            self._start(key)
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name=f"{self.name}-supervisor", daemon=True)
            self._supervisor.start()

    def _start(self, key: str) -> None:
        fn, make_args, options = self._specs[key]
        arguments = make_args()
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
            workers = options["workers"]
            self._running[key] = self.client.submit(
                fn, *arguments, pure=False, workers=workers, allow_other_workers=bool(workers),
                key=f"{self.name}-{key}-{uuid.uuid4().hex[:8]}")

    def _finished(self, key: str) -> tuple[bool, BaseException | None, str]:
        running = self._running[key]
        if self.client is None:
            thread, outcome = running
            if thread.is_alive():
                return False, None, ""
            return True, outcome.get("error"), outcome.get("traceback", "")
        if not running.done():
            return False, None, ""
        if running.status in ("error", "cancelled"):
            try:
                error = running.exception(timeout=5)
                trace = "".join(traceback.format_tb(running.traceback(timeout=5)))
            except Exception as lost:  # cancelled futures have no exception to fetch
                error, trace = lost, ""
            return True, error, trace
        return True, None, ""

    def record_error(self, where: str, error: BaseException, trace: str = "") -> None:
        """Keep, log and print an error (of a piece, or of the supervision step): never swallowed.

        Only the last ``MAX_KEPT_ERRORS`` are kept (``error_count`` counts all); an error repeating
        the previous one of the same ``where`` (e.g. every poll) is kept and counted, printed once."""
        message = f"{self.name} {where} raised {type(error).__name__}: {error}"
        self.errors.append((where, f"{message}\n{trace}"))
        del self.errors[:-MAX_KEPT_ERRORS]
        self.error_count += 1
        if self._last_message.get(where) == message:
            logger.debug("%s (again)", message)
            return
        self._last_message[where] = message
        logger.error(message)
        print(message, file=sys.stderr, flush=True)

    def poll_once(self) -> list[str]:
        """Relaunch every piece that ended while not stopping; returns their keys."""
        relaunched = []
        with self._lock:
            for key in list(self._running):
                done, error, trace = self._finished(key)
                if not done or self._stopping:
                    continue
                if error is not None:
                    self.record_error(f"{self.piece} {key}", error, trace)
                if self.restarts >= self.max_restarts:
                    logger.error("%s gave up %s after %d restarts", self.name, key, self.restarts)
                    del self._running[key]
                    continue
                self.restarts += 1
                self._start(key)
                relaunched.append(key)
        return relaunched

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

    def stop(self, stop_flag: Any, timeout: float = 30.0) -> None:
        """Set ``stop_flag`` (the flag the pieces watch) and wait for every piece to end."""
        self._stopping = True
        stop_flag.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout)
        deadline = time.monotonic() + timeout
        for running in self._running.values():
            remaining = max(deadline - time.monotonic(), 0.1)
            if self.client is None:
                running[0].join(remaining)
            else:
                with contextlib.suppress(Exception):  # errors were recorded by the supervisor
                    running.result(timeout=remaining)
        self._running.clear()
        self._supervisor = None
