"""Where a service runs: worker addresses or names, and Dask resources used as labels.

CARLS runs its trainer on an accelerator and its makers and bank shards on CPU machines (CARLS
sections 1 and 3). A :class:`Placement` says which workers a service may use; every service
(maker slices, bank shards, summary aggregators, ES workers, the learner and its gradient store,
evaluation workers) takes one through ``workers=`` / ``resources=`` arguments and keeps it across
restarts: a service rebuilt after a lost worker is placed by the same rule among the live workers.

Resources are *labels* here: a worker started with ``--resources "maker=1"`` may hold any number of
maker slices. (Passed to Dask as task resources, a long-running task would hold its unit for as long
as it runs, and a second slice would wait forever.) So carlskit resolves a placement to the
addresses of the live workers that match it and restricts each task or actor to those.

The default placement keeps services off accelerator workers (those offering a ``GPU``, ``TPU``
or ``accelerator`` resource) unless every worker is one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from carlskit._checks import finite_float, instance
from carlskit._errors import WorkerLostError
from carlskit.cluster._environment import ACCELERATOR_RESOURCES


class NoWorkerError(WorkerLostError):
    """No live worker matches a service's placement (yet): retried under its restart policy."""


def live_workers(client: Any) -> dict[str, dict[str, Any]]:
    """The scheduler's live workers now: address -> its ``scheduler_info`` entry (name, resources,
    status, ...), fetched by one call to the scheduler.

    Not ``client.scheduler_info(n_workers=-1)["workers"]``: that refreshes the client's cached
    identity and returns the cache, which the client's own periodic refresh (every
    ``distributed.client.scheduler-info-interval``, 2 s) overwrites with a copy *without workers*;
    when the two overlap, a caller in another thread reads no workers at all (distributed
    2026.8: 10 of 500 calls with a 5 ms interval; ``tests/cluster/test_live_workers.py``), and a
    service took its live workers for lost (a finished remote fit was submitted again).
    """
    if getattr(client, "asynchronous", False):
        raise TypeError("live_workers needs a synchronous Client (await client.scheduler.identity() instead)")
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def is_accelerator(resources: Mapping[str, float]) -> bool:
    """Whether a worker offering ``resources`` (its Dask resources) is an accelerator worker
    (a ``GPU``, ``TPU`` or ``accelerator`` resource > 0)."""
    return any(name.lower() in ACCELERATOR_RESOURCES and amount > 0 for name, amount in resources.items())


def check_resources(resources: Any, name: str = "resources") -> dict[str, float]:
    """``resources`` (Dask worker resources, name -> amount) as a dict: TypeError for another type,
    a name that is not a str or an amount that is not a number; ValueError for an empty name or an
    amount not > 0."""
    instance(resources, name, Mapping, "a dict of resource name -> amount")
    for key, amount in resources.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{name} names must be non-empty str, got {key!r}")
        finite_float(amount, f"{name}[{key!r}]", positive=True)
    return dict(resources)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The workers a service may run on.

    Args:
      workers: worker addresses (``"tcp://10.0.0.5:40123"``) or names (``"makers-0"``, ``"1"``);
        ``None`` for any worker. A name survives its worker's restart by a nanny (a new process at
        a new address), so a service placed by name returns to the replacement worker.
      resources: Dask resources a worker must offer, e.g. ``{"maker": 1}`` (at least that amount
        of each); ``None`` for none. Without either, accelerator workers are left out unless every
        worker is one.
    """

    workers: tuple[str, ...] | None = None
    resources: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if self.workers is not None:
            if isinstance(self.workers, str) or not isinstance(self.workers, Iterable):
                raise TypeError(f"workers must be a list of worker addresses or names, got {self.workers!r}")
            workers = tuple(self.workers)
            if not workers or not all(isinstance(worker, str) and worker for worker in workers):
                raise ValueError(f"workers must be a non-empty list of worker addresses or names, got {self.workers!r}")
            object.__setattr__(self, "workers", workers)
        if self.resources is not None:
            object.__setattr__(self, "resources", check_resources(self.resources))

    @classmethod
    def of(cls, workers: Iterable[str] | str | None = None,
           resources: Mapping[str, float] | None = None) -> Placement:
        """A placement from a service's ``workers=`` and ``resources=`` arguments (one address may be a str)."""
        if isinstance(workers, str):
            workers = (workers,)
        return cls(workers, resources)

    @property
    def restricted(self) -> bool:
        return self.workers is not None or bool(self.resources)

    def matches(self, address: str, info: Mapping[str, Any]) -> bool:
        """Whether a worker (its address and ``scheduler_info`` entry) satisfies this placement."""
        if self.workers is not None and address not in self.workers and str(info.get("name")) not in self.workers:
            return False  # names are compared as text: LocalCluster names its workers 0, 1, ...
        offered = info.get("resources") or {}
        return all(offered.get(name, 0) >= amount for name, amount in (self.resources or {}).items())

    def candidates(self, client: Any) -> list[str]:
        """Addresses of the live workers this placement allows, sorted (stable round robin)."""
        workers = live_workers(client)
        chosen = sorted(address for address, info in workers.items() if self.matches(address, info))
        if self.restricted:
            return chosen
        general = [address for address in chosen if not is_accelerator(workers[address].get("resources") or {})]
        return general or chosen

    def choose(self, client: Any, index: int = 0, exclude: Iterable[str] = (),
               load: Mapping[str, float] | None = None) -> str:
        """The worker a service goes to: with ``load`` (address -> services it holds), the
        least-loaded candidate (ties by address); else the ``index``-th (round robin). ``exclude``
        (e.g. the worker just lost) is avoided when another candidate is live.

        Raises :class:`NoWorkerError` when no live worker matches.
        """
        candidates = self.candidates(client)
        excluded = set(exclude)
        preferred = [address for address in candidates if address not in excluded] or candidates
        if not preferred:
            raise NoWorkerError(f"no live worker matches the placement {self}")
        if load is not None:
            return min(preferred, key=lambda address: (load.get(address, 0), address))
        return preferred[index % len(preferred)]

    def __str__(self) -> str:
        parts = []
        if self.workers is not None:
            parts.append(f"workers={list(self.workers)}")
        if self.resources:
            parts.append(f"resources={self.resources}")
        return ", ".join(parts) or "any non-accelerator worker"
