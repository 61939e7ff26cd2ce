"""Tasks: the inner problems a learned optimizer trains, and the families meta-training samples.

A :class:`~carlskit.lopt.Task` is a frozen, hashable problem structure (``init``, ``batch``,
``loss``, optional ``sample_task_params``); a :class:`~carlskit.lopt.TaskFamily` samples
structures. Built in: quadratics, MLPs, autoencoders and a convnet on the bundled scikit-learn
data sets, least squares, deep linear networks, low-rank matrix completion, the parameter-rescaling
augmentation, and the problem sets of the shipped optimizer: what it was meta-trained on
(:func:`meta_training_family`, :func:`wide_meta_training_family`), what picks its checkpoint
(:func:`validation_problems`) and what it is judged on (:func:`held_out_problems`,
:func:`evaluation_problems`).
"""

from carlskit.lopt._protocols import Task, TaskFamily
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
    RescaledFamily,
    RescaledTask,
    dataset_arrays,
    evaluation_problems,
    held_out_problems,
    meta_training_family,
    validation_problems,
    wide_meta_training_family,
)

__all__ = [
    "Task", "TaskFamily", "DATASETS", "dataset_arrays",
    "QuadraticTask", "QuadraticFamily", "DigitsMLPTask", "DigitsMLPFamily", "DigitsConvTask", "ConvFamily",
    "MLPTask", "MLPFamily", "AutoencoderTask", "AutoencoderFamily", "LinearRegressionTask",
    "LinearRegressionFamily", "DeepLinearTask", "MatrixCompletionTask", "MixtureFamily", "RescaledTask",
    "RescaledFamily", "meta_training_family", "wide_meta_training_family", "validation_problems",
    "held_out_problems", "evaluation_problems",
]
