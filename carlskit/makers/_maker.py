"""``Maker``: asynchronous knowledge makers (CARLS paper section 3.1).

A maker loops until stopped: when the trainer has published a checkpoint newer than the one it
used last, it loads the newest *intact* one, recomputes knowledge for its slice of the items and
writes it to the bank with the checkpoint's version. With a Dask client each slice runs as a
long-running task on a worker (it secedes from the worker's thread pool, so it never blocks other
tasks or actors); without one, slices run in threads of this process.

Failures (CARLS runs makers for hours beside a trainer, on workers that get preempted):

- The maker's function travels inside each slice's task (never ``scatter``-ed: scattered data dies
  with its worker and cannot be recomputed), so a slice whose worker dies is rerun by Dask on another
  worker at once and loads the latest checkpoint: it catches up, skipping the versions published
  meanwhile (a maker always takes the newest).
- A slice that raises, or whose task is lost for good, is relaunched by the supervision layer
  (:class:`carlskit.cluster.LongRunningTasks`) with exponential backoff under ``restart_policy``, a
  budget in seconds; when it is spent the slice is given up: ``status()`` says ``"gave up"`` and
  :meth:`Maker.check` / :meth:`Maker.wait_for_version` raise :class:`carlskit.ServiceGaveUpError`.
- A damaged checkpoint (:class:`carlskit.CorruptFileError`) is skipped and its reason recorded in
  ``status()``; the slice takes the newest intact version and reads the damaged one no more. It is
  not a failure: it neither restarts the slice nor spends its budget.

CPU budget (``max_cpu_fraction``): CARLS runs makers *beside* a trainer, often on the same cores. A
maker that refreshes a large table is always busy (a round of 1M nodes outlasts many checkpoints)
and would take those cores from the trainer's step. Each slice therefore works at most
``max_cpu_fraction`` of wall time: after every chunk of work (a batch of an :class:`EmbeddingMaker`,
or a whole round of a maker function that does not call :meth:`MakerContext.pace`) it sleeps
``busy * (1 - f) / f``, so the duty cycle holds whatever the chunk size. A round still completes,
only more slowly (its rate is ``f`` times the unpaced one). Busy time is wall time spent between
pacing points; with one XLA thread per worker (``carlskit.cluster.connect``'s default
``threads_per_worker=1``) that is one core's CPU time.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from carlskit._checks import instance, positive_float, positive_int
from carlskit._errors import ServiceGaveUpError
from carlskit.checkpoints import CheckpointStore, restore_model
from carlskit.cluster import (
    LongRunningTasks,
    Placement,
    RestartPolicy,
    log_worker_event,
    secede_if_on_worker,
    stop_flag,
)
from carlskit.cluster import restart_policy as as_restart_policy

logger = logging.getLogger("carlskit.makers")

MakerFn = Callable[["MakerContext"], None]
KEPT_EVENTS = 1000  # recent events a maker keeps for events(); status() keeps only each slice's latest
KEPT_SKIPS = 20  # damaged versions remembered per slice in status()


class Pacer:
    """Keep one slice's busy fraction of wall time at most ``max_cpu_fraction`` (see the module doc).

    ``pace()`` ends a chunk of work: it sleeps ``busy * (1 - f) / f`` where ``busy`` is the time
    since the previous ``pace()`` (or :meth:`resume`), then starts the next chunk's clock. With
    ``f = 1`` it never sleeps. ``busy_seconds`` and ``slept_seconds`` add up what it measured.
    """

    def __init__(self, max_cpu_fraction: float = 1.0, stop: Any = None):
        fraction = positive_float(max_cpu_fraction, "max_cpu_fraction")
        if fraction > 1.0:
            raise ValueError(f"max_cpu_fraction must be in (0, 1], got {max_cpu_fraction}")
        self.max_cpu_fraction = fraction
        self._stop = stop
        self.busy_seconds = 0.0
        self.slept_seconds = 0.0
        self._since = time.perf_counter()

    def resume(self) -> None:
        """Start a chunk's clock (after an idle wait that is not the maker's work)."""
        self._since = time.perf_counter()

    def pace(self) -> None:
        """End a chunk of work: sleep so that busy / (busy + slept) stays <= ``max_cpu_fraction``."""
        busy = time.perf_counter() - self._since
        self.busy_seconds += busy
        pause = busy * (1.0 - self.max_cpu_fraction) / self.max_cpu_fraction
        if pause > 0 and not (self._stop is not None and self._stop.is_set()):
            time.sleep(pause)
            self.slept_seconds += pause
        self.resume()


@dataclass
class MakerContext:
    """What a maker function receives for one round: the checkpoint, its items, the bank."""

    items: np.ndarray
    version: int
    checkpoint: dict[str, np.ndarray]
    metadata: dict
    bank: Any
    slice_index: int
    pacer: Pacer = dataclasses.field(default_factory=Pacer)

    def pace(self) -> None:
        """Call between chunks of a round's work: sleeps to keep the slice within the maker's
        ``max_cpu_fraction`` (a no-op for an unpaced maker)."""
        self.pacer.pace()

    def restore_model(self, model, prefix: str = "model") -> None:
        """Load the checkpoint's ``prefix`` subtree (the trainer's model state) into ``model``."""
        restore_model(model, self.checkpoint, self.metadata, prefix)


# Embedded (thread) mode: topic -> the running maker's event handler. Entries are removed when the
# maker stops, so this holds one entry per running maker, not every message ever sent.
_LOCAL_HANDLERS: dict[str, Callable[[tuple[float, dict]], None]] = {}


def _report(topic: str, message: dict) -> None:
    """Send a status message to the client (Dask event) or to the maker in this process (threads)."""
    if not log_worker_event(topic, message):  # not on a worker: embedded mode
        handler = _LOCAL_HANDLERS.get(topic)
        if handler is not None:
            handler((time.time(), message))


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:
        return "local thread"


def run_maker_slice(fn: MakerFn, items: np.ndarray, slice_index: int, store_path: str, bank: Any,
                    stop: Any, topic: str, poll_seconds: float, max_rounds: int | None, launch: int = 0,
                    max_cpu_fraction: float = 1.0) -> int:
    """The loop one slice runs (on a worker or a thread) until ``stop`` is set; returns rounds run.

    The slice's work is paced to ``max_cpu_fraction`` of wall time (a :class:`Pacer`: the maker
    function's own ``context.pace()`` calls, and one at the end of every round). ``launch``
    numbers the supervisor's launches of this slice: a second ``started`` event with the same
    number is Dask rerunning the task after its worker was lost.
    """
    secede_if_on_worker()  # runs for as long as training does; in thread mode there is no slot to free
    _report(topic, {"slice": slice_index, "event": "started", "launch": launch, "worker": _worker_address()})
    store = CheckpointStore(store_path, keep=None)

    def skipped(version: int, reason: str) -> None:  # once per damaged version (and manifest content)
        logger.warning("maker slice %d skips checkpoint version %d: %s", slice_index, version, reason)
        _report(topic, {"slice": slice_index, "event": "skipped", "version": version, "reason": reason})

    pacer = Pacer(max_cpu_fraction, stop)
    current, rounds = None, 0
    while not stop.is_set() and (max_rounds is None or rounds < max_rounds):
        start = time.perf_counter()
        pacer.resume()
        loaded = store.load_latest(newer_than=current, on_skip=skipped)
        if loaded is None:
            time.sleep(poll_seconds)
            continue
        version, checkpoint, metadata = loaded
        busy, slept = pacer.busy_seconds, pacer.slept_seconds
        if fn(MakerContext(items, version, checkpoint, metadata, bank, slice_index, pacer)) is False:
            time.sleep(poll_seconds)  # its inputs are not in the bank yet: retry this version
            continue
        pacer.pace()  # the round's last chunk (all of it, for a function that never calls pace())
        seconds = time.perf_counter() - start
        current, rounds = version, rounds + 1
        _report(topic, {"slice": slice_index, "event": "round", "version": version, "items": len(items),
                        "seconds": seconds, "round": rounds, "busy_seconds": pacer.busy_seconds - busy,
                        "slept_seconds": pacer.slept_seconds - slept})
    return rounds


async def _import_maker_modules() -> None:
    """Run by ``client.run(wait=False)`` (which takes only coroutines): the import runs in a thread,
    off the worker's event loop."""
    import asyncio
    import importlib

    await asyncio.get_running_loop().run_in_executor(None, importlib.import_module, "carlskit.makers")


class _SliceState:
    """What the client knows of one slice, from its events (bounded: latest round, last skips)."""

    def __init__(self) -> None:
        self.round: dict | None = None
        self.launches_started: set[int] = set()
        self.reruns = 0  # Dask reran a launch after its worker was lost
        self.worker: str | None = None
        self.skipped: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.started_at: float | None = None


class Maker:
    """Run ``fn`` over slices of ``items`` whenever a newer checkpoint is published.

    Args:
      fn: ``fn(context: MakerContext)``; computes knowledge for ``context.items`` from
        ``context.checkpoint`` (leaves by path) and writes it with
        ``context.bank.update(..., version=context.version)``. Returning ``False`` says its inputs
        are not ready yet (e.g. embeddings another maker writes): the round is retried. It is
        pickled into every slice's task (and re-sent with every relaunch).
      items: the item keys this maker is responsible for (split into ``num_slices`` slices).
      num_slices: parallel slices (one Dask task or thread each).
      name: shown in status and events.
      poll_seconds: how often a slice checks for a new checkpoint.
      workers, resources: where the slices may run (:class:`carlskit.cluster.Placement`: worker
        addresses or names, and/or Dask resources a worker must offer, e.g. ``{"maker": 1}``, used
        as labels, so one worker holds any number of slices). A relaunched slice keeps its
        placement. By default slices stay off accelerator workers when there are others.
      restart_policy: how a failing slice is relaunched: a :class:`carlskit.cluster.RestartPolicy`,
        a budget in seconds (keep relaunching for that long after failures began, with exponential
        backoff), or ``None`` for the default policy (10 minutes).
      max_cpu_fraction: in (0, 1]: the share of wall time each slice may compute; it sleeps
        between chunks to hold it (see the module doc), so a trainer sharing its cores keeps its
        step time. ``1`` (the default) never sleeps. A round takes about ``1 / f`` times longer.
    """

    def __init__(self, fn: MakerFn, items: np.ndarray, *, num_slices: int = 1, name: str | None = None,
                 poll_seconds: float = 0.2, workers: list[str] | str | None = None,
                 resources: dict[str, float] | None = None,
                 restart_policy: RestartPolicy | float | None = None, max_cpu_fraction: float = 1.0):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        items = np.asarray(items)
        if items.ndim != 1 or not np.issubdtype(items.dtype, np.integer) or len(items) == 0:
            raise ValueError(f"items must be a non-empty 1-D int array, got {items.dtype} {items.shape}")
        if positive_int(num_slices, "num_slices") > len(items):
            raise ValueError(f"num_slices must be in [1, {len(items)}] (one item per slice at least), got {num_slices}")
        if name is not None:
            instance(name, "name", str, "a str or None")
        self.fn = fn
        self.items = items.astype(np.int64)
        self.num_slices = int(num_slices)
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.poll_seconds = positive_float(poll_seconds, "poll_seconds")
        self.placement = Placement.of(workers, resources)
        self.restart_policy = as_restart_policy(restart_policy, "restart_policy")
        self.max_cpu_fraction = Pacer(max_cpu_fraction).max_cpu_fraction  # checked here, before any slice runs
        self._topic = f"carlskit-maker-{self.name}-{uuid.uuid4().hex[:8]}"
        self._client = None
        self._store: CheckpointStore | None = None
        self._stop = None
        self._tasks: LongRunningTasks | None = None  # the slices, supervised (restarted on failure)
        self._past_errors: list[tuple[str, str]] = []
        self._past_restarts = 0
        self._past_gave_up: dict[str, str] = {}
        self._launches = [0] * self.num_slices
        self._state_lock = threading.Lock()
        self._slices = [_SliceState() for _ in range(self.num_slices)]
        self._events: collections.deque[dict] = collections.deque(maxlen=KEPT_EVENTS)
        self._supervision: dict[str, dict] = {}  # the slices' supervision state when last stopped
        self._started = 0.0

    @property
    def errors(self) -> list[tuple[str, str]]:
        """``(slice, message with traceback)`` of recent failures, over all runs of this maker."""
        return self._past_errors + (self._tasks.errors if self._tasks is not None else [])

    @property
    def restarts(self) -> int:
        """Relaunches of slices by the supervisor plus reruns by Dask after a lost worker."""
        return self._past_restarts + self._current_restarts()

    def _current_restarts(self) -> int:  # of this run (start() folds the previous runs' into _past_restarts)
        with self._state_lock:
            return sum(max(launches - 1, 0) + state.reruns for launches, state in zip(self._launches, self._slices))

    @property
    def gave_up(self) -> dict[str, str]:
        """``{slice: reason}`` of slices abandoned after their restart budget was spent."""
        return {**self._past_gave_up, **(self._tasks.gave_up if self._tasks is not None else {})}

    @property
    def slices(self) -> list[np.ndarray]:
        return np.array_split(self.items, self.num_slices)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, checkpoints: CheckpointStore, bank: Any, client: Any = None) -> Maker:
        """Start every slice; returns self. ``client=None`` runs slices in threads here."""
        if self._tasks is not None:
            raise RuntimeError(f"maker {self.name!r} is already running")
        instance(checkpoints, "checkpoints", CheckpointStore, "a CheckpointStore")
        self._topic = f"carlskit-maker-{self.name}-{uuid.uuid4().hex[:8]}"  # this run's events only
        self._store, self._bank, self._client = checkpoints, bank, client
        self._started = time.time()
        with self._state_lock:
            self._past_restarts += sum(max(launches - 1, 0) + state.reruns
                                       for launches, state in zip(self._launches, self._slices))
            self._launches = [0] * self.num_slices
            self._slices = [_SliceState() for _ in range(self.num_slices)]
        if client is None:
            _LOCAL_HANDLERS[self._topic] = self._on_event
        else:
            client.subscribe_topic(self._topic, self._on_event)  # before any slice can report
            # Every worker imports the makers' modules (JAX, Flax) now, in the background, so a slice
            # rerun on a surviving worker after its own was lost starts at once: that import was 15 s
            # of an 18 s recovery on a loaded 2-core machine.
            client.run(_import_maker_modules, wait=False)
        self._stop = stop_flag(client, f"{self._topic}-stop")
        self._tasks = LongRunningTasks(client, f"maker-{self.name}", piece="slice", policy=self.restart_policy)
        for index in range(self.num_slices):
            # A slice whose worker is lost is rerun by Dask on another allowed worker, or relaunched
            # by the supervisor among the live ones that match its placement.
            self._tasks.launch(str(index), run_maker_slice, self._slice_arguments(index), placement=self.placement)
        return self

    def _slice_arguments(self, index: int) -> Callable[[], tuple]:
        def make_args() -> tuple:  # called for every launch: fn travels with the task each time
            with self._state_lock:
                launch = self._launches[index]
                self._launches[index] += 1
            return (self.fn, self.slices[index], index, self._store.path, self._bank, self._stop,
                    self._topic, self.poll_seconds, None, launch, self.max_cpu_fraction)

        return make_args

    def _on_event(self, event: tuple[float, dict]) -> None:
        """Fold one slice event into its state (runs on the client's event loop or a slice thread)."""
        timestamp, message = event
        index = message.get("slice")
        if not isinstance(index, int) or not 0 <= index < self.num_slices:
            return
        with self._state_lock:
            self._events.append(message)
            state = self._slices[index]
            kind = message.get("event")
            if kind == "started":
                if message["launch"] in state.launches_started:
                    state.reruns += 1
                state.launches_started.add(message["launch"])
                state.worker, state.started_at = message["worker"], timestamp
            elif kind == "skipped":
                state.skipped[message["version"]] = message["reason"]
                while len(state.skipped) > KEPT_SKIPS:
                    state.skipped.popitem(last=False)
            elif kind == "round":
                state.round = message

    def check(self) -> None:
        """Raise :class:`carlskit.ServiceGaveUpError` if a slice was given up (its budget spent)."""
        gave_up = self.gave_up
        if gave_up:
            raise ServiceGaveUpError(f"maker {self.name!r}: " + "; ".join(gave_up.values()))

    def wait_for_version(self, version: int, timeout: float = 120.0) -> None:
        """Block until every slice has written knowledge for ``version`` or newer.

        Raises :class:`carlskit.ServiceGaveUpError` as soon as a slice is given up, and
        ``TimeoutError`` (with the maker's errors and skipped checkpoints, if any) when that takes
        over ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            slices = self.status()["slices"]
            versions = [s["version"] for s in slices]
            if all(v is not None and v >= version for v in versions):
                return
            if time.monotonic() > deadline:
                skipped = {v: r for s in slices for v, r in s["skipped"].items()}
                raise TimeoutError(f"maker {self.name!r} slices reached versions {versions}, not {version}, "
                                   f"within {timeout:g} s; errors: {[e for _, e in self.errors][:1]}"
                                   + (f"; skipped damaged checkpoints: {skipped}" if skipped else ""))
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every slice and wait for them to end."""
        if self._tasks is None:
            return
        self._tasks.stop(self._stop, timeout)
        self._past_errors, self._past_gave_up = self.errors, self.gave_up
        self._supervision = self._tasks.status()
        self._tasks = None
        if self._client is None:
            _LOCAL_HANDLERS.pop(self._topic, None)
        else:
            try:
                self._client.unsubscribe_topic(self._topic)
            except Exception as error:  # the client closed first: nothing left to release
                logger.debug("unsubscribe %s: %s", self._topic, error)

    # -- status ----------------------------------------------------------------------------------
    def events(self) -> list[dict]:
        """The last ``KEPT_EVENTS`` messages of this run's slices (started, round, skipped)."""
        with self._state_lock:
            return list(self._events)

    def status(self) -> dict:
        """Per slice: supervision ``state`` (running, restarting, gave up, stopped), ``version``,
        ``lag`` (intact checkpoints published since), items/s, ``restarts``, ``worker``, ``skipped``
        (damaged checkpoints: ``{version: reason}``), ``running_since`` (wall time its current run
        started); plus the maker's restarts and errors."""
        published = self._store.versions() if self._store is not None else []
        supervision = self._tasks.status() if self._tasks is not None else self._supervision
        slices = []
        with self._state_lock:
            for index, state in enumerate(self._slices):
                message = state.round
                version = None if message is None else message["version"]
                watched = supervision.get(str(index), {})
                slices.append({
                    "slice": index,
                    "state": watched.get("state", "not started"),
                    "version": version,
                    # checkpoints published since, that it can still use (not those it found damaged)
                    "lag": sum((version is None or v > version) and v not in state.skipped for v in published),
                    "items_per_s": None if message is None else message["items"] / max(message["seconds"], 1e-9),
                    # the last round's share of wall time spent computing (<= max_cpu_fraction)
                    "busy_fraction": None if message is None else
                    message.get("busy_seconds", 0.0) / max(message["seconds"], 1e-9),
                    "rounds": 0 if message is None else message["round"],
                    "restarts": max(self._launches[index] - 1, 0) + state.reruns,
                    "worker": state.worker,
                    "running_since": state.started_at,
                    "skipped": dict(state.skipped),
                    "reason": watched.get("reason"),
                })
        return {"name": self.name, "slices": slices, "restarts": self.restarts,
                "errors": [e for _, e in self.errors], "gave_up": list(self.gave_up.values())}

    def __repr__(self) -> str:
        status = self.status()
        versions = [s["version"] for s in status["slices"]]
        states = sorted({s["state"] for s in status["slices"]})
        return (f"<Maker {self.name!r}: {self.num_slices} slice(s) {'/'.join(states)}, versions {versions}, "
                f"restarts {status['restarts']}, errors {len(status['errors'])}>")
