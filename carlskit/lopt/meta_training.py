"""Meta-training: how a learned optimizer's meta-parameters are trained.

* Inner training, vmapped over task instances: :func:`train_task`, :func:`train_tasks_vectorized`
  (and the Python-loop reference :func:`train_tasks_serial`), :func:`unroll`, :func:`inner_step`,
  :func:`init_inner_state`, :class:`InnerState`, :func:`aggregate_losses`, and issue 41's meta-loss
  :func:`mean_log_loss_ratio` (final loss against tuned Adam's, in log).
* Outer-gradient estimators, pure and jitted: antithetic full-unroll ES
  (:func:`make_full_es_estimator`, :func:`full_es_gradient`) and truncated PES
  (:func:`make_pes_estimator`, :func:`pes_gradient`, :func:`pes_init_state`, :class:`PESEstimator`,
  :class:`PESState`; episode lengths optionally log-uniform), :func:`antithetic_combine`,
  :func:`task_mesh` (pairs split over devices); :func:`self_optimizer` (the learned optimizer as its
  own outer optimizer).
* The cluster of Metz et al. 2020, App. H.1, on Dask: :class:`MetaTraining` (ES or PES workers,
  :class:`GradientStore`, :class:`Learner` with per-family monitoring, :class:`EvaluationChief` over
  :class:`EvalTaskSet` s, :func:`default_eval_task_sets`, :func:`evaluation_curves`).

The outer step's two halves (``worker_estimate`` / ``learner_apply`` and their helpers) are
internal: :mod:`carlskit.lopt._outer`.
"""

from carlskit.lopt._estimators import (
    PESEstimator,
    PESState,
    antithetic_combine,
    full_es_gradient,
    make_full_es_estimator,
    make_pes_estimator,
    pes_gradient,
    pes_init_state,
    task_mesh,
)
from carlskit.lopt._evaluation import EvalTaskSet, EvaluationChief, default_eval_task_sets, evaluation_curves
from carlskit.lopt._gradient_store import GradientStore
from carlskit.lopt._inner import (
    InnerState,
    aggregate_losses,
    init_inner_state,
    inner_step,
    mean_log_loss_ratio,
    train_task,
    train_tasks_serial,
    train_tasks_vectorized,
    unroll,
)
from carlskit.lopt._learner import Learner
from carlskit.lopt._meta_training import MetaTraining
from carlskit.lopt._outer import self_optimizer

__all__ = [
    "MetaTraining", "GradientStore", "Learner", "EvaluationChief", "EvalTaskSet", "default_eval_task_sets",
    "evaluation_curves", "make_full_es_estimator", "make_pes_estimator", "full_es_gradient", "pes_gradient",
    "pes_init_state", "PESEstimator", "PESState", "antithetic_combine", "task_mesh", "self_optimizer",
    "train_task", "train_tasks_vectorized", "train_tasks_serial", "unroll", "inner_step", "init_inner_state",
    "InnerState", "aggregate_losses", "mean_log_loss_ratio",
]
