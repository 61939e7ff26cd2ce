"""Versioned checkpoints of pytrees, below every part that reads or writes them.

The trainer publishes checkpoints, makers restore the newest intact one into their model copy, and
meta-training's learner and evaluation chief keep their meta-parameters in them; so the store lives
here, below ``training``, ``makers`` and ``lopt``, and none of them imports another for it.
``carlskit.CheckpointStore`` and ``carlskit.training.CheckpointStore`` are the same class.

- :class:`CheckpointStore`: ``v{version}.npz`` + checksummed manifest, written atomically, every
  byte verified on read (:class:`carlskit.CorruptFileError` otherwise); ``latest()`` skips damaged
  versions.
- :func:`restore_model`: load a checkpoint's arrays into an ``nnx.Module`` in place.
"""

from carlskit.checkpoints._store import CheckpointStore, restore_model

__all__ = ["CheckpointStore", "restore_model"]
