"""Per-task-family monitoring of meta-training (Metz et al. 2020, App. H.1: the learner watches each
task family's loss and gradient variance to find the families that diverge or dominate).

``update_family_stats(stats, records, outer_step)`` folds the applied gradient records of one learner
update into ``stats`` (a JSON-able dict, kept in the learner's checkpoint metadata so a resumed
learner continues the figures) and returns the new dict; the old one is never changed. Per family
(the records' ``task_family``):

* ``loss_all``: mean outer loss over every record of the family applied so far;
* ``loss_latest`` / ``latest_step``: mean outer loss of the family's records in the latest update
  that held any, and that update's outer step;
* ``grad_variance``: the outer-gradient variance over every record of the family so far, averaged
  over the meta-parameters' coordinates (``trace(Cov) / dim``, Welford's running algorithm, so no
  record is kept); ``None`` until two records came. A family whose estimates disagree (noisy or
  diverging unrolls) stands out here before its loss moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def update_family_stats(stats: dict[str, dict[str, Any]], records: list[dict[str, Any]], outer_step: int
                        ) -> dict[str, dict[str, Any]]:
    """``stats`` with the applied ``records`` of the update that reached ``outer_step`` folded in."""
    new = {name: dict(values) for name, values in stats.items()}
    batch: dict[str, list[float]] = {}
    for record in records:
        name = record["task_family"]
        grad = np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in record["grad"]])
        family = new.setdefault(name, {"count": 0, "loss_sum": 0.0, "grad_mean": None, "grad_m2": 0.0})
        count = family["count"] + 1
        mean = np.zeros_like(grad) if family["grad_mean"] is None else np.asarray(family["grad_mean"], np.float64)
        delta = grad - mean
        mean = mean + delta / count
        family.update(count=count, loss_sum=family["loss_sum"] + float(record["outer_loss"]),
                      grad_mean=mean.tolist(), grad_m2=family["grad_m2"] + float(np.sum(delta * (grad - mean))))
        batch.setdefault(name, []).append(float(record["outer_loss"]))
    for name, losses in batch.items():
        family = new[name]
        family.update(loss_latest=float(np.mean(losses)), latest_step=int(outer_step),
                      loss_all=family["loss_sum"] / family["count"],
                      grad_variance=(family["grad_m2"] / (family["count"] - 1) / len(family["grad_mean"])
                                     if family["count"] > 1 else None))
    return new


def family_summary(stats: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per family, without the running sums: ``task_family``, ``count``, ``loss_all``,
    ``loss_latest``, ``latest_step``, ``grad_variance`` (what ``status()`` and widgets show)."""
    keys = ("count", "loss_all", "loss_latest", "latest_step", "grad_variance")
    return [{"task_family": name, **{key: values.get(key) for key in keys}} for name, values in stats.items()]


def summary_label(task_family: str) -> str:
    """``task_family`` as a summary-name component (no ``/``, which separates name levels)."""
    return task_family.replace("/", "|")
