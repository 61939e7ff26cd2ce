"""Learned optimizers (Metz et al. 2020): per-parameter MLP optimizer, tasks, ES/PES meta-training.

The layout, one concept per module:

* Contracts (``_protocols``): ``UpdateRule``, ``Task``, ``TaskFamily``, runtime-checkable
  ``typing.Protocol`` s in the style of optax's ``GradientTransformation``; every function below
  is typed against them, and any object with their methods qualifies.
* Built-ins: rules ``MLPUpdateRule``, ``HierarchicalRule`` (per-tensor MLP over Adam-like
  directions, the shipped one), ``LearnableAdamRule`` (``_rules``); tasks and families
  (``_tasks``): ``QuadraticTask``/``QuadraticFamily``, ``DigitsMLPTask``/``DigitsMLPFamily``,
  ``DigitsConvTask``/``ConvFamily``, ``MLPTask``/``MLPFamily`` and ``AutoencoderTask``/
  ``AutoencoderFamily`` on the bundled scikit-learn data sets (``DATASETS``, ``dataset_arrays``),
  ``LinearRegressionTask``/``LinearRegressionFamily``, ``MixtureFamily``; the shipped optimizer's
  ``meta_training_family()`` and the ``held_out_problems()`` it never saw.
* Inner training (``_inner``): ``inner_step``, the one inner step that training and evaluation
  both run; ``unroll``, ``train_task``, ``train_tasks_vectorized``, ``train_tasks_serial``,
  ``init_inner_state``, ``InnerState``, ``aggregate_losses``.
* Outer-gradient estimators (``_estimators``, pure): ``full_es_gradient``, ``pes_gradient``,
  ``pes_init_state``, ``make_full_es_estimator``, ``make_pes_estimator``, ``antithetic_combine``,
  ``task_mesh`` (split PES pairs over devices), ``PESEstimator``, ``PESState``.
* The outer step (``_outer``), one core: ``worker_estimate`` (an estimate packed as a gradient
  record, ``Estimators`` caching one estimator per task structure, ``OuterStream`` the task and
  keys of each step) and ``learner_apply`` (judge records, the NaN guard, average, apply the outer
  optimizer to a ``LearnerState`` under a ``LearnerConfig``); ``self_optimizer``, the learned
  optimizer as its own outer optimizer (self-training, ``outer_optimizer="self"``).
* Single process: ``LearnedOptimizer`` (``as_optax``, save/load, ``pretrained``,
  ``meta_train`` = ``worker_estimate`` + ``learner_apply`` in a loop), ``LearnableAdam``,
  ``optax_train_curves``; the tuned baselines ``tuned_adam`` (Adam at its best of
  ``ADAM_LEARNING_RATES``), ``tuned_sgd_learning_rate`` and ``tuned_learning_rate`` (any optax optimizer);
  ``compare_to_tuned_adam`` (the per-problem table), ``final_loss``, ``geometric_mean_ratio``.
* The meta-training cluster (Metz et al. 2020, App. H.1), the same core distributed: ES workers
  (``worker_estimate``) -> ``GradientStore`` -> ``Learner`` (``learner_apply``), driven and
  supervised by ``MetaTraining`` (the learner and its store are one service, ``_learner_service``,
  built from :mod:`carlskit.cluster`'s service kit like every other); ``EvaluationChief`` with ``EvalTaskSet``,
  ``default_eval_task_sets`` and ``evaluation_curves`` (which run ``inner_step``).

Nothing here imports ipywidgets, matplotlib or pandas at load: widgets (``carlskit.widgets``)
are imported where they are shown.
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
    train_task,
    train_tasks_serial,
    train_tasks_vectorized,
    unroll,
)
from carlskit.lopt._learner import Learner
from carlskit.lopt._meta_training import MetaTraining
from carlskit.lopt._optimizer import (
    ADAM_LEARNING_RATES,
    WIDE_ADAM_LEARNING_RATES,
    LearnableAdam,
    LearnedOptimizer,
    compare_at_horizons,
    compare_to_tuned_adam,
    final_loss,
    geometric_mean_ratio,
    optax_train_curves,
    summarize_comparison,
    tuned_adam,
    tuned_learning_rate,
    tuned_sgd_learning_rate,
)
from carlskit.lopt._outer import (
    Estimators,
    LearnerConfig,
    LearnerState,
    OuterStream,
    learner_apply,
    self_optimizer,
    worker_estimate,
)
from carlskit.lopt._protocols import Task, TaskFamily, UpdateRule
from carlskit.lopt._rules import HierarchicalRule, LearnableAdamRule, MLPUpdateRule
from carlskit.lopt._tasks import (
    DATASETS,
    AutoencoderFamily,
    AutoencoderTask,
    ConvFamily,
    DeepLinearTask,
    DigitsConvTask,
    DigitsMLPFamily,
    DigitsMLPTask,
    LinearRegressionFamily,
    LinearRegressionTask,
    MatrixCompletionTask,
    MixtureFamily,
    MLPFamily,
    MLPTask,
    QuadraticFamily,
    QuadraticTask,
    dataset_arrays,
    evaluation_problems,
    held_out_problems,
    meta_training_family,
)

__all__ = [
    "ADAM_LEARNING_RATES", "DATASETS", "AutoencoderFamily", "AutoencoderTask", "ConvFamily", "HierarchicalRule",
    "LinearRegressionFamily", "LinearRegressionTask", "MLPFamily", "MLPTask", "MixtureFamily",
    "WIDE_ADAM_LEARNING_RATES", "DeepLinearTask", "MatrixCompletionTask", "compare_at_horizons",
    "evaluation_problems", "summarize_comparison", "compare_to_tuned_adam",
    "dataset_arrays", "final_loss", "geometric_mean_ratio", "held_out_problems",
    "meta_training_family", "DigitsConvTask", "DigitsMLPFamily", "DigitsMLPTask", "Estimators", "EvalTaskSet",
    "EvaluationChief",
    "GradientStore", "InnerState", "LearnableAdam", "LearnableAdamRule", "LearnedOptimizer", "Learner",
    "LearnerConfig", "LearnerState", "MLPUpdateRule", "MetaTraining", "OuterStream", "PESEstimator", "PESState",
    "QuadraticFamily", "QuadraticTask", "Task", "TaskFamily", "UpdateRule", "aggregate_losses",
    "antithetic_combine", "default_eval_task_sets", "evaluation_curves", "full_es_gradient", "init_inner_state",
    "inner_step", "learner_apply", "make_full_es_estimator", "make_pes_estimator", "optax_train_curves",
    "pes_gradient", "pes_init_state", "self_optimizer", "task_mesh", "train_task", "train_tasks_serial",
    "train_tasks_vectorized", "tuned_adam", "tuned_learning_rate", "tuned_sgd_learning_rate", "unroll",
    "worker_estimate",
]
