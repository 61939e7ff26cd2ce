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
