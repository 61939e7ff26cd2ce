"""``History``: what every training loop returns, one record per step.

``Trainer.fit``, ``MoEModel.fit``, ``TranslationModel.fit`` and ``LearnedOptimizer.meta_train``
all return (and keep) a :class:`History`: a ``list`` of dicts, one per step, in step order, each
with ``step`` (steps done when the record was made: 1 for the first) and the loop's numbers
(``loss`` and metrics; ``outer_loss`` for meta-training). A record may lack a key that other
records have (``eval_loss`` only on evaluation steps). Being a list, it is what ``pd.DataFrame``,
``json.dumps`` and slicing expect; :meth:`History.column` gives one quantity as an array.

It lives below ``training``, ``moe`` and ``lopt`` (it imports only NumPy) so that each of them
returns it without importing another.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class History(list):
    """A training run's records: a ``list`` of ``{"step": int, name: value, ...}`` dicts in step order."""

    def column(self, name: str) -> np.ndarray:
        """The values of ``name`` in the records that have it, in order, as one array (array-valued
        records such as ``expert_load`` stack to ``[records, ...]``).

        Raises ``KeyError`` naming the keys the records have when none has ``name``."""
        values = [record[name] for record in self if name in record]
        if not values and self:
            keys = sorted({key for record in self for key in record})
            raise KeyError(f"no record has {name!r}; the records have {keys}")
        return np.asarray(values)

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of the records that have ``name``: a curve to plot against step."""
        records = [record for record in list(self) if name in record]  # a snapshot: a loop may append meanwhile
        return np.asarray([r["step"] for r in records]), np.asarray([r[name] for r in records])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str):  # the old dict-of-lists reading, history["loss"]: say what replaced it
            raise TypeError(f"a History is a list of per-step records: use history.column({index!r}) "
                            f"(or [record[{index!r}] for record in history])")
        item = super().__getitem__(index)
        return History(item) if isinstance(index, slice) else item

    def __repr__(self) -> str:
        if not self:
            return "History([])"
        keys = list(dict.fromkeys(key for record in self[-1:] for key in record))
        return f"History({len(self)} records, steps {self[0]['step']}..{self[-1]['step']}, keys {keys})"
