"""One supervised service's state machine (:class:`ServiceState`), its status row
(:class:`ServiceStatus`) and the one give-up message (:func:`give_up_message`); see
:mod:`carlskit.cluster._service` for the kit they belong to."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from carlskit._errors import ServiceGaveUpError
from carlskit.cluster._placement import Placement
from carlskit.cluster._policy import Backoff, RestartPolicy, restart_policy

logger = logging.getLogger("carlskit.cluster")

#: The states a service row shows, in the order of the supervision rule.
STATES = ("running", "restarting", "waiting", "gave up", "stopped")


@dataclasses.dataclass(frozen=True, eq=False)
class ServiceStatus(Mapping):
    """One service's supervision state: the row ``ClusterStatus`` shows for every service.

    A read-only mapping over its fields (``details`` flattened in), so it compares equal to, and is
    read like, the dict rows of earlier releases.

    Args:
      state: ``"running"``, ``"restarting"``, ``"waiting"`` (for a service it depends on),
        ``"gave up"`` (its restart budget spent) or ``"stopped"``.
      failures: failures in the current streak (0 when healthy).
      budget_left_seconds: seconds of restart budget left in the streak (the whole budget when healthy).
      reason: why it is not running (the last failure, or the give-up message); ``None`` when running.
      placement: the :class:`Placement` it runs under, as text.
      worker: the worker address running it (``"this process"`` embedded; ``None`` unknown).
      details: service-specific figures (restarts, held entries...), shown as extra columns.
    """

    state: str
    failures: int = 0
    budget_left_seconds: float = 0.0
    reason: str | None = None
    placement: str | None = None
    worker: str | None = None
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state must be one of {list(STATES)}, got {self.state!r}")

    def _fields(self) -> dict[str, Any]:
        return {"state": self.state, "failures": self.failures, "budget_left_seconds": self.budget_left_seconds,
                "reason": self.reason, "placement": self.placement, "worker": self.worker, **self.details}

    def __getitem__(self, key: str) -> Any:
        return self._fields()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields())

    def __len__(self) -> int:
        return len(self._fields())

    def row(self, service: str) -> dict[str, Any]:
        """This status as one table row named ``service`` (what ``ClusterStatus`` draws)."""
        return {"service": service, **self._fields()}

    def __repr__(self) -> str:
        return f"ServiceStatus({self._fields()!r})"


def give_up_message(owner: str, what: str, failures: int, budget_seconds: float, reason: str,
                    note: str = "") -> str:
    """The one give-up message: ``"<owner>: gave up <what> after <n> failures in <budget> s
    (restart budget spent); [note; ]last: <reason>"``."""
    note = f"{note}; " if note else ""
    return (f"{owner}: gave up {what} after {failures} failures in {budget_seconds:g} s "
            f"(restart budget spent); {note}last: {reason}")


class ServiceState:
    """The state machine of one supervised service, under one :class:`RestartPolicy`.

    ``running`` --:meth:`failed`--> ``restarting`` (after the backoff delay the owner retries) --
    :meth:`recovered`--> ``running``; :meth:`failed` once the budget is spent --> ``gave up`` (final:
    :meth:`check` raises :class:`carlskit.ServiceGaveUpError`, the message is logged and printed
    once). :meth:`wait` marks a service waiting for another one (no failure counted), and
    :meth:`stop` a service stopped on request.

    Args:
      owner: who runs the service, first in the give-up message (``"meta-training"``).
      what: the service, as the give-up message names it (``"the learner"``).
      policy: a :class:`RestartPolicy`, a budget in seconds, or ``None`` for the defaults.
      placement: where it runs, shown in its :meth:`status` row.
      clock: the clock of the backoff (tests pass a hand-advanced one).
    """

    def __init__(self, owner: str, what: str, policy: RestartPolicy | float | None = None, *,
                 placement: Placement | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.owner, self.what = owner, what
        self.policy = restart_policy(policy, "policy")
        self.placement = placement
        self.backoff = Backoff(self.policy, clock)
        self.state = "stopped"
        self.reason: str | None = None
        #: the give-up message once the budget is spent, else ``None``.
        self.gave_up: str | None = None
        self.restarts = 0

    def start(self) -> None:
        """Running, with a fresh budget (a new start after :meth:`stop`, or a first one)."""
        self.backoff.success()
        self.state, self.reason, self.gave_up = "running", None, None

    def failed(self, reason: BaseException | str, note: str = "") -> float | None:
        """Record a failure: ``restarting`` and the seconds to wait before the next try, or ``None``
        once the budget is spent (``gave up``, with :func:`give_up_message` and ``note``)."""
        if isinstance(reason, BaseException):
            reason = f"{type(reason).__name__}: {reason}"
        delay = self.backoff.failure()
        if delay is None:
            self.gave_up = give_up_message(self.owner, self.what, self.backoff.failures,
                                           self.policy.budget_seconds, reason, note)
            self.state, self.reason = "gave up", self.gave_up
            logger.error(self.gave_up)
            print(self.gave_up, file=sys.stderr, flush=True)
            return None
        self.state, self.reason = "restarting", reason
        return delay

    def recovered(self, *, restarted: bool = False) -> None:
        """Running again (the streak ends); ``restarted``: after a rebuild (counted in ``restarts``)."""
        self.backoff.success()
        self.restarts += bool(restarted)
        if self.state != "gave up":
            self.state, self.reason = "running", None

    def resumed(self) -> None:
        """Running again after a restart; the streak (and its budget) goes on until :meth:`recovered`."""
        if self.state != "gave up":
            self.state, self.reason = "running", None

    def wait(self, reason: str) -> None:
        """Waiting for a service it depends on: no failure counted."""
        if self.state != "gave up":
            self.state, self.reason = "waiting", reason

    def stop(self) -> None:
        if self.state != "gave up":
            self.state, self.reason = "stopped", None

    def ready(self) -> bool:
        """Whether the backoff delay of the last failure has passed."""
        return self.backoff.ready()

    def check(self) -> None:
        """Raise :class:`carlskit.ServiceGaveUpError` if the service was given up."""
        if self.gave_up is not None:
            raise ServiceGaveUpError(self.gave_up)

    def status(self, worker: str | None = None, **details: Any) -> ServiceStatus:
        """Its :class:`ServiceStatus` row (``details``: service-specific columns)."""
        return ServiceStatus(self.state, self.backoff.failures, round(self.backoff.seconds_left(), 3), self.reason,
                             None if self.placement is None else str(self.placement), worker, details)
