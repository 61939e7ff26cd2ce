"""Learned optimizers (Metz et al. 2022): per-parameter MLP optimizer, tasks, ES/PES meta-training.

Public names: ``LearnedOptimizer``, ``LearnableAdam``, the pure update rules ``MLPUpdateRule`` and
``LearnableAdamRule``, tasks (``Task``, ``TaskFamily``, ``QuadraticTask``, ``QuadraticFamily``,
``DigitsMLPTask``, ``DigitsMLPFamily``, ``DigitsConvTask``), inner training
(``train_tasks_vectorized``, ``train_tasks_serial``) and the outer-gradient estimators
(``full_es_gradient``, ``pes_gradient``, ``pes_init_state``, ``make_full_es_estimator``,
``make_pes_estimator``, ``task_mesh`` for splitting PES pairs over devices), and the meta-training
cluster (Metz et al. 2022, App. H.1): ``MetaTraining``, ``GradientStore``, ``Learner``,
``EvaluationChief``, ``EvalTaskSet``, ``default_eval_task_sets``, ``evaluation_curves``.
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
    train_task,
    train_tasks_serial,
    train_tasks_vectorized,
    unroll,
)
from carlskit.lopt._learner import Learner
from carlskit.lopt._meta_training import MetaTraining
from carlskit.lopt._optimizer import LearnableAdam, LearnedOptimizer, optax_train_curves, tuned_sgd_learning_rate
from carlskit.lopt._rules import LearnableAdamRule, MLPUpdateRule
from carlskit.lopt._tasks import (
    DigitsConvTask,
    DigitsMLPFamily,
    DigitsMLPTask,
    QuadraticFamily,
    QuadraticTask,
    Task,
    TaskFamily,
)

__all__ = [
    "DigitsConvTask", "DigitsMLPFamily", "DigitsMLPTask", "EvalTaskSet", "EvaluationChief", "GradientStore",
    "InnerState", "Learner", "MetaTraining", "default_eval_task_sets", "evaluation_curves", "LearnableAdam",
    "LearnableAdamRule",
    "LearnedOptimizer", "MLPUpdateRule", "PESEstimator", "PESState", "QuadraticFamily", "QuadraticTask", "Task",
    "TaskFamily", "aggregate_losses", "antithetic_combine", "full_es_gradient", "init_inner_state",
    "make_full_es_estimator", "make_pes_estimator", "optax_train_curves", "pes_gradient", "pes_init_state",
    "task_mesh", "train_task", "train_tasks_serial", "train_tasks_vectorized", "tuned_sgd_learning_rate", "unroll",
]
