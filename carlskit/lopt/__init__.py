"""Learned optimizers (Metz et al. 2020): per-parameter learned update rules usable as optax
transformations, the tasks they train, and their meta-training, in three concepts:

* **Rules and optimizers** (this namespace): the contract ``UpdateRule``; the rules
  ``MLPUpdateRule``, ``HierarchicalRule`` (per-tensor MLP over Adam-like directions, the shipped
  one), ``NominalAdamRule`` (Adam's direction, a learned schedule and a bounded learned
  correction; it reads the loss and the run's length) and ``LearnableAdamRule``;
  ``LearnedOptimizer`` (``as_optax``, save/load, ``pretrained``, single-process ``meta_train``)
  and ``LearnableAdam``; the baselines and the comparison with them:
  ``optax_train_curves``, ``tuned_adam`` / ``tuned_learning_rate`` / ``tuned_sgd_learning_rate``
  over ``ADAM_LEARNING_RATES`` or ``WIDE_ADAM_LEARNING_RATES``, ``compare_to_tuned_adam``,
  ``compare_at_horizons`` (issue 30's protocol), ``summarize_comparison``, ``final_loss``,
  ``geometric_mean_ratio``.
* **Tasks** (:mod:`carlskit.lopt.tasks`): the ``Task`` / ``TaskFamily`` contracts, the built-in
  problems and families, the rescaling augmentation, and the problem sets of the shipped optimizer.
* **Meta-training** (:mod:`carlskit.lopt.meta_training`): vmapped inner training, the ES / PES
  estimators, and the cluster of Metz et al. 2020, App. H.1 (``MetaTraining``: ES or PES workers,
  ``GradientStore``, ``Learner`` with per-family monitoring, ``EvaluationChief``).

The outer step's internals (``worker_estimate`` / ``learner_apply``, ``Estimators``,
``OuterStream``, ``LearnerConfig``, ``LearnerState``) live in :mod:`carlskit.lopt._outer` and are
not public. The names of the two concept namespaces stay importable from here too (as before the
split), but are documented where they belong. Nothing here imports ipywidgets, matplotlib or pandas
at load: widgets (``carlskit.widgets``) are imported where they are shown.
"""

from carlskit.lopt import meta_training, tasks
from carlskit.lopt._nominal import NominalAdamRule
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
from carlskit.lopt._protocols import UpdateRule
from carlskit.lopt._rules import HierarchicalRule, LearnableAdamRule, MLPUpdateRule
from carlskit.lopt.meta_training import *  # noqa: F403  (importable from here as before the split)
from carlskit.lopt.tasks import *  # noqa: F403

__all__ = [
    "UpdateRule", "MLPUpdateRule", "HierarchicalRule", "NominalAdamRule", "LearnableAdamRule", "LearnedOptimizer",
    "LearnableAdam",
    "optax_train_curves", "ADAM_LEARNING_RATES", "WIDE_ADAM_LEARNING_RATES", "tuned_adam", "tuned_learning_rate",
    "tuned_sgd_learning_rate", "compare_to_tuned_adam", "compare_at_horizons", "summarize_comparison",
    "final_loss", "geometric_mean_ratio", "tasks", "meta_training",
]
