"""Exception types shared by every subpackage: callers catch these, never match message text.

- :class:`CorruptFileError`: a durable file (checkpoint, bank snapshot, learned-optimizer file,
  evaluation state, summary file) fails its checksum or cannot be parsed. A ``ValueError``, so code
  that treated "bad file" as a bad value keeps working; ``path`` names the file.
- :class:`WorkerLostError`: a process that held a service (an actor, a long-running task) is gone.
  The bank's ``ShardLostError`` is one; :func:`carlskit.cluster.is_worker_loss` recognises these and
  distributed's own types.
- :class:`ServiceGaveUpError`: a supervised service kept failing for longer than its restart budget
  (in seconds) and was abandoned; raised in the owner's process (``Trainer.fit``,
  ``MetaTraining.wait``, ``Maker.wait_for_version``, the summary writer's next call).
- :class:`RankFailedError`: a process of a :func:`carlskit.cluster.run_spmd` group raised, exited,
  or the group timed out; every rank was ended. ``rank`` names it (``None`` for the whole group),
  ``kind`` says how (``"raised"``, ``"exited"``, ``"timed out"``).
- :class:`RankLostError`: the Dask worker of a rank was lost (a :class:`WorkerLostError`, so a
  ``restart_policy`` relaunches the group).
"""

from __future__ import annotations

import os


class CorruptFileError(ValueError):
    """A durable file is damaged (checksum mismatch, truncated, unparsable): never loaded."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path, self.problem = os.fspath(path), problem
        super().__init__(f"{self.path}: corrupt file ({problem})")

    def __reduce__(self):  # picklable across Dask with its two arguments
        return (type(self), (self.path, self.problem))


class WorkerLostError(RuntimeError):
    """The worker process that held a service is gone (killed, crashed, disconnected)."""


class ServiceGaveUpError(RuntimeError):
    """A supervised service failed for longer than its restart budget and was given up."""


def _rank_message(rank: int | None, cause: str, logs: str) -> str:
    who = "the process group" if rank is None else f"rank {rank}"
    tail = f"\n--- {who}'s last output ---\n{logs}" if logs else ""
    return f"{who} {cause}; every rank was ended{tail}"


class RankFailedError(RuntimeError):
    """A rank of a process group raised, exited or hung; every rank of the group was ended."""

    def __init__(self, rank: int | None, kind: str, cause: str, logs: str = "") -> None:
        self.rank, self.kind, self.cause, self.logs = rank, kind, cause, logs
        super().__init__(_rank_message(rank, cause, logs))

    def __reduce__(self):
        return (type(self), (self.rank, self.kind, self.cause, self.logs))


class RankLostError(WorkerLostError):
    """The Dask worker of a rank of a process group was lost; every rank of the group was ended."""

    def __init__(self, rank: int, worker: str, logs: str = "") -> None:
        self.rank, self.worker, self.logs = rank, worker, logs
        super().__init__(_rank_message(rank, f"lost its worker {worker}", logs))

    def __reduce__(self):
        return (type(self), (self.rank, self.worker, self.logs))
