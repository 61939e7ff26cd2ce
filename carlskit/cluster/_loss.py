"""Is this error the loss of a worker? Decided by exception type, never by message text.

One helper for every service (makers, ES and evaluation workers, the learner, summary aggregators,
bank shards). Dask reports a lost worker in several ways, each a type:

- ``distributed.comm.CommClosedError`` (an ``OSError``): the connection to it closed mid-call;
- ``distributed.KilledWorker``: the scheduler gave up a task whose workers kept dying;
- ``FutureCancelledError`` / ``concurrent.futures.CancelledError`` / ``asyncio.CancelledError``:
  the task's future was cancelled (its data was lost, or the client released it);
- :class:`carlskit.WorkerLostError` and its subclasses (the bank's ``ShardLostError``).

An *actor* whose worker died reports a plain ``RuntimeError`` (distributed's "Worker holding Actor
was lost"), so for actors the deciding fact is the state of the future that created it:
:func:`actor_lost` (its status is no longer ``"finished"``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from carlskit._errors import WorkerLostError


def _loss_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [WorkerLostError, concurrent.futures.CancelledError,
                                        asyncio.CancelledError]
    try:
        from distributed import KilledWorker
        from distributed.comm.core import CommClosedError
    except ImportError:  # no Dask: only our own and the standard library's
        return tuple(types)
    types += [KilledWorker, CommClosedError]
    return tuple(types)


def is_worker_loss(error: BaseException | None) -> bool:
    """True when ``error`` (or an exception it was raised from) says a worker process is gone."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, _loss_types()):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


LOST_STATES = frozenset({"error", "cancelled", "lost"})


def actor_lost(actor_future: Any) -> bool:
    """True when the actor created by ``actor_future`` (``client.submit(Cls, actor=True)``) is gone:
    its future left ``"finished"`` for ``"lost"``, ``"cancelled"`` or ``"error"``. A ``"pending"``
    future (a watch on an actor's key whose state has not arrived yet) says nothing of a loss."""
    return actor_future is not None and actor_future.status in LOST_STATES
