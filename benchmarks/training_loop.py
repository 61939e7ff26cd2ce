"""The one training loop's cost: ``MoEModel.fit`` (a :class:`carlskit.training.Trainer`: prefetch
thread, per-step record, display) against the bare loop it replaced (the same jitted step called in
a Python loop, metrics fetched every step), on the capacity sweep's small MoE model.

Each variant trains a fresh model ``--steps`` steps on the same batches; its measurement is the
mean time per step after the first ``--skip`` (tracing and compiling), from its own clock. The
variants run interleaved, ``--repeats`` times (``benchmarks/_timing.py``).

    python benchmarks/training_loop.py [--steps 60] [--repeats 5]
Last line: JSON with trainer_over_bare_step (median of per-repeat ratios; 1.0 = no cost), its
spread, and both medians in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleave, medians, ratio  # noqa: E402

from carlskit._step import make_train_step  # noqa: E402
from carlskit.moe import MoEModel, toy_multilingual_corpus  # noqa: E402

LENGTH, BATCH = 32, 16


def model() -> MoEModel:
    return MoEModel(64, 2, 32, 2, 8, capacity_factor=1.25, aux_loss_weight=1e-2, max_length=LENGTH, seed=0)


def trainer_loop(corpus: np.ndarray, steps: int, skip: int) -> float:
    history = model().fit(corpus, steps=steps, batch_size=BATCH, learning_rate=3e-3, seed=0)
    return per_step(history.column("seconds"), skip)


def bare_loop(corpus: np.ndarray, steps: int, skip: int) -> float:
    """What ``MoEModel.fit`` was before it ran a Trainer: the shared step in a plain loop."""
    trained = model()
    graphdef, state = nnx.split((trained, nnx.Optimizer(trained, optax.adam(3e-3), wrt=nnx.Param)))
    step_fn = jax.jit(make_train_step(graphdef, lambda m, b: m.loss_and_metrics(b["tokens"], rng=b["rng"]),
                                      check_finite=False))
    rows = np.random.default_rng(0).integers(0, len(corpus), (steps, BATCH))
    key = jax.random.key(0)
    stamps = []
    for step in range(steps):
        batch = {"tokens": trained.shard_batch(corpus[rows[step]]), "rng": jax.random.fold_in(key, step)}
        state, _, metrics, _ = step_fn(state, batch)
        _ = {k: np.asarray(v) for k, v in metrics.items()}  # the old loop's per-step host sync
        stamps.append(time.perf_counter())
    return per_step(np.asarray(stamps), skip)


def per_step(stamps: np.ndarray, skip: int) -> float:
    """Mean seconds per step after the first ``skip``: a median of the single steps would pick the
    steps that ran inside one time slice of a loaded machine."""
    return float((stamps[-1] - stamps[skip]) / (len(stamps) - 1 - skip))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    corpus, _ = toy_multilingual_corpus(512, LENGTH, num_languages=8, vocab_size=64)
    samples = interleave({"trainer": lambda: trainer_loop(corpus, args.steps, args.skip),
                          "bare": lambda: bare_loop(corpus, args.steps, args.skip)}, repeats=args.repeats,
                         warmup=False)
    result = {**ratio(samples, "trainer", "bare", "trainer_over_bare_step"),
              **{f"{name}_step_ms": 1e3 * seconds for name, seconds in medians(samples).items()},
              "steps": args.steps, "repeats": args.repeats}
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
