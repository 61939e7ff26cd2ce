"""``LoopDisplay``: the one bar + live plot + summaries object that Trainer.fit, MoEModel.fit,
meta_train and the GAM paradigm show."""

import optax
from tiny_models import Linear, mse, sum_batch

from carlskit import History
from carlskit._notebook import LoopDisplay
from carlskit.lopt import LearnableAdam, QuadraticTask
from carlskit.training import Trainer


class Scalars:
    """A summary writer as the Trainer takes one (``scalar(name, value, step)``), keeping what it gets."""

    def __init__(self):
        self.written = []

    def scalar(self, name, value, step):
        self.written.append((name, float(value), step))


def test_records_reach_the_bar_the_summaries_the_plot_and_the_callback(capsys):
    history, seen, summaries = History(), [], Scalars()
    display = LoopDisplay(history, 3, "loop", live=True, curves=("loss", "absent"), title="t", postfix="loss",
                          summaries=summaries, prefix="x/", plot_every=2, callback=seen.append)
    for step in (1, 2, 3):
        history.append({"step": step, "loss": 1.0 / step, "load": [1.0, 2.0]})
        display.record(history[-1])
    display.close()
    display.show_final_frames()
    assert seen == list(history)
    assert summaries.written == [("x/loss", 1.0, 1), ("x/loss", 0.5, 2), ("x/loss", 1.0 / 3, 3)]  # scalars only
    assert display.plot.renders == 2  # the second record (plot_every=2) and close()
    assert list(display._series()) == ["loss"]  # a curve no record has is left out
    assert "loop: 100%" in capsys.readouterr().err


def test_the_trainer_meta_training_and_moe_fit_share_the_display(capsys):
    trainer = Trainer(Linear(), optax.sgd(0.01), mse, summaries=Scalars())
    seen = []
    history = trainer.fit(sum_batch, 4, progress="shared", live=True, callback=seen.append)
    assert isinstance(history, History) and seen == list(history) and len(history) == 4
    assert [name for name, _, step in trainer.summaries.written if step == 1] == ["train/loss", "train/step_seconds"]
    trained = LearnableAdam().meta_train(QuadraticTask(4), 3, estimator="es", num_tasks=2, horizon=4,
                                         live_plot=True, plot_every=1)
    assert isinstance(trained.history, History) and [r["step"] for r in trained.history] == [1, 2, 3]
    err = capsys.readouterr().err
    assert "shared: 100%" in err and "meta-train (es): 100%" in err and "outer_loss=" in err
