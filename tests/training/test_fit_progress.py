"""Trainer.fit's progress bar: labelled with what it trains, and created in the calling thread (so a
notebook shows a background fit's bar under the cell that started it)."""

from __future__ import annotations

import threading

import optax
import tqdm.auto
from tiny_models import Linear, mse, sum_batch

from carlskit.training import Trainer

batch = sum_batch


def test_a_string_labels_the_bar_on_stderr(capsys):
    Trainer(Linear(), optax.sgd(0.01), mse).fit(batch, 3, progress="linear model on sums")
    assert "linear model on sums: 100%" in capsys.readouterr().err
    Trainer(Linear(), optax.sgd(0.01), mse).fit(batch, 3, progress=True)
    assert "train: 100%" in capsys.readouterr().err


def test_a_background_fits_bar_is_created_in_the_calling_thread(monkeypatch):
    created_in = []
    original = tqdm.auto.tqdm

    class Recording(original):
        def __init__(self, *args, **kwargs):
            created_in.append(threading.current_thread())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    handle = Trainer(Linear(), optax.sgd(0.01), mse).fit(batch, 5, block=False, progress="background", live=False)
    handle.wait()
    assert created_in == [threading.current_thread()]


def test_the_first_step_compiling_is_left_out_of_the_bars_rate(capsys):
    from carlskit._notebook import step_done

    now = [0.0]  # the bar's clock, advanced by hand: elapsed is computed, not timed
    bar = tqdm.auto.tqdm(total=100, desc="eta", mininterval=0)
    bar._time = lambda: now[0]
    bar.start_t = bar.last_print_t = 0.0
    now[0] = 100.0  # the first step: tracing and compiling
    step_done(bar, 1.0)
    for _ in range(9):  # nine steps of 0.1 s
        now[0] += 0.1
        step_done(bar, 0.5)
    elapsed = bar.format_dict["elapsed"]
    bar.close()
    assert abs(elapsed - 0.9) < 1e-6, f"the compilation counted in the bar's clock: {elapsed} s for 9 steps of 0.1 s"
    Trainer(Linear(), optax.sgd(0.01), mse).fit(batch, 3, progress="first")
    assert "first: 100%" in capsys.readouterr().err
