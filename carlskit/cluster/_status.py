"""The one status row of a supervised service, and the one give-up message (see
:mod:`carlskit.cluster._service` for the kit they belong to)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

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
