"""The service kit: what every supervised service in carlskit is built from.

dask/distributed keeps one ``retry`` (``distributed/utils_comm.py``) and one
``SpecCluster._correct_state`` that every caller uses; this module is carlskit's equivalent. Each
piece exists once here, and the bank transport, the summary writer, meta-training, the evaluation
chief, makers and remote fits use it:

- :class:`ServiceStatus`: the one typed status row of a service (state, failures in the streak,
  restart budget left, last reason, placement, worker, plus service-specific ``details``). It is a
  read-only mapping, so ``status()["services"][name]["state"]`` reads as before, and it is what
  :class:`carlskit.widgets.ClusterStatus` shows, one row per service.
- :class:`ServiceState`: the state machine of one service (``running``, ``restarting``,
  ``waiting``, ``gave up``, ``stopped``) over one :class:`~carlskit.cluster.Backoff` under a
  :class:`~carlskit.cluster.RestartPolicy`, with the one give-up message (:func:`give_up_message`)
  and :meth:`ServiceState.check`, which raises :class:`carlskit.ServiceGaveUpError` in the owner's
  process.
- :class:`ActorHost`: one Dask actor that is placed through :meth:`Placement.choose` (the
  least-loaded live worker of its placement), whose loss is told by state
  (:func:`~carlskit.cluster.actor_lost`, or its worker gone from the scheduler), and that is
  rebuilt on a live worker, releasing the old actor's future.
- :func:`retry_on_worker_loss`: call a function again, with backoff, while it fails by losing a
  worker (decided by type, :func:`~carlskit.cluster.is_worker_loss`); any other error is raised at
  once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from carlskit._errors import ServiceGaveUpError
from carlskit.cluster._loss import actor_lost, is_worker_loss
from carlskit.cluster._placement import Placement, live_workers
from carlskit.cluster._policy import Backoff, RestartPolicy, restart_policy
from carlskit.cluster._status import give_up_message

logger = logging.getLogger("carlskit.cluster")
T = TypeVar("T")

#: How long an actor's construction may take on a fresh worker (JAX import, a checkpoint load).
ACTOR_START_SECONDS = 120.0


class ActorHost:
    """One Dask actor that is placed, watched and rebuilt.

    :meth:`start` places it through :meth:`Placement.choose` (the least-loaded live worker of the
    placement, given ``load``; a named ``worker`` wins), builds it and releases the future of the
    actor it replaces. :meth:`lost` tells its loss by state: the future that created it left
    ``"finished"``, or its worker left the scheduler (never by message text). :meth:`rebuild` starts
    it again away from the lost worker. :meth:`submit` and :meth:`adopt` split :meth:`start` in two
    for owners that must not block while it is built (the summary writer's flush thread).

    Args:
      client: a ``distributed.Client``.
      placement: where it may run (default: any non-accelerator worker).
      name: prefix of its task keys.
    """

    def __init__(self, client: Any, placement: Placement | None = None, name: str = "actor") -> None:
        self.client, self.placement, self.name = client, placement or Placement(), name
        self.actor: Any = None
        self.future: Any = None
        self.worker: str | None = None
        self.creating: Any = None  # the future of an actor being built (submit, then adopt)
        self._creating_worker: str | None = None

    def choose(self, exclude: Iterable[str] = (), load: Mapping[str, float] | None = None) -> str:
        """The worker a new actor goes to: :meth:`Placement.choose` among the live ones."""
        return self.placement.choose(self.client, exclude=exclude, load=load)

    def submit(self, factory: Callable, *args: Any, worker: str | None = None, exclude: Iterable[str] = (),
               load: Mapping[str, float] | None = None, **kwargs: Any) -> Any:
        """Start building ``factory(*args, **kwargs)`` as an actor (not waited on); its future."""
        worker = worker if worker is not None else self.choose(exclude, load)
        self._creating_worker = worker
        self.creating = self.client.submit(factory, *args, actor=True, pure=False, workers=[worker],
                                           allow_other_workers=False,
                                           key=f"{self.name}-{uuid.uuid4().hex[:8]}", **kwargs)
        return self.creating

    def adopt(self, timeout: float | None = ACTOR_START_SECONDS) -> Any:
        """Wait for the actor :meth:`submit` started and make it this host's (the old future is
        released). On an error the half-built one is released and the old actor kept."""
        future, self.creating = self.creating, None
        if future is None:
            raise RuntimeError(f"{self.name}: no actor is being built (call submit first)")
        try:
            actor = future.result(timeout=timeout)
        except BaseException:
            future.release()
            raise
        old = self.future
        self.actor, self.future = actor, future
        try:
            holders = self.client.who_has(future).get(future.key) or ()
        except Exception:  # noqa: BLE001 - the placement's choice stands
            holders = ()
        self.worker = holders[0] if holders else self._creating_worker
        if old is not None:
            old.release()
        return actor

    def start(self, factory: Callable, *args: Any, worker: str | None = None, exclude: Iterable[str] = (),
              load: Mapping[str, float] | None = None, timeout: float | None = ACTOR_START_SECONDS,
              **kwargs: Any) -> Any:
        """Build ``factory(*args, **kwargs)`` as this host's actor on a chosen worker; the actor."""
        self.submit(factory, *args, worker=worker, exclude=exclude, load=load, **kwargs)
        return self.adopt(timeout)

    def rebuild(self, factory: Callable, *args: Any, load: Mapping[str, float] | None = None,
                timeout: float | None = ACTOR_START_SECONDS, **kwargs: Any) -> Any:
        """:meth:`start` again, on a live worker other than the lost one when there is one."""
        exclude = () if self.worker is None else (self.worker,)
        return self.start(factory, *args, exclude=exclude, load=load, timeout=timeout, **kwargs)

    def lost(self) -> bool:
        """Whether the actor is gone: its future's state, or its worker missing from the scheduler."""
        if self.future is not None and actor_lost(self.future):
            return True
        return self.actor is not None and worker_gone(self.client, self.worker)

    def release(self) -> None:
        """Release the actor's futures (the actor ends once no one else holds it)."""
        for future in (self.future, self.creating):
            if future is not None:
                try:
                    future.release()
                except Exception:  # noqa: BLE001 - the client is closing: nothing left to release
                    pass
        self.future = self.creating = self.actor = None


def worker_gone(client: Any, address: str | None) -> bool:
    """Whether ``address`` has left ``client``'s scheduler (``False`` when unknown or unanswered)."""
    if client is None or address is None:
        return False
    try:
        return address not in live_workers(client)
    except Exception:  # noqa: BLE001 - no answer from the scheduler: nothing known
        return False


def retry_on_worker_loss(attempt: Callable[[], T], *, policy: RestartPolicy | float | None = None,
                         what: str = "the call", on_retry: Callable[[BaseException, float], None] | None = None,
                         sleep: Callable[[float], None] = time.sleep) -> T:
    """``attempt()``, called again after a backoff delay for as long as it fails by losing a worker.

    A failure counts when :func:`~carlskit.cluster.is_worker_loss` says so (by type); any other
    error is raised at once. Once the policy's budget is spent, raises
    :class:`carlskit.ServiceGaveUpError` (a ``RuntimeError``) with :func:`give_up_message`, from the
    last loss.

    Args:
      attempt: the call to make (no arguments).
      policy: a :class:`RestartPolicy`, a budget in seconds, or ``None`` for the defaults.
      what: what is retried, as the give-up message names it.
      on_retry: called with ``(error, delay_seconds)`` before each wait.
      sleep: how to wait (tests pass a fake).

    Returns:
      What ``attempt()`` returned.
    """
    backoff = Backoff(restart_policy(policy, "policy"))
    while True:
        try:
            return attempt()
        except BaseException as error:  # noqa: BLE001 - only a lost worker is retried
            if not is_worker_loss(error):
                raise
            delay = backoff.failure()
            if delay is None:
                raise ServiceGaveUpError(give_up_message(
                    what, "retrying: workers kept being lost", backoff.failures, backoff.policy.budget_seconds,
                    f"{type(error).__name__}: {error}")) from error
            if on_retry is not None:
                on_retry(error, delay)
            sleep(delay)
