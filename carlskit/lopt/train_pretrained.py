"""Meta-train the MLP learned optimizer that ships with carlskit (``LearnedOptimizer.pretrained()``).

Reproduce the committed file (about 10 minutes on a 2-core CPU)::

    python -m carlskit.lopt.train_pretrained --out carlskit/lopt/pretrained_mlp_lopt.npz

PES (truncation 50, horizon 200, 8 antithetic pairs per outer step, vmapped) on the four width-32
structures of ``DigitsMLPFamily`` (depth 1-2, relu/tanh; few structures keep compile time low),
starting from ``MLPUpdateRule``'s momentum prior, Adam on the meta-parameters. The loop stops at
``--outer-steps`` or ``--time-budget-s``, whichever comes first, so the step count is recorded in
the JSON description stored inside the ``.npz`` (one file, written atomically).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from carlskit.lopt._optimizer import LearnedOptimizer
from carlskit.lopt._tasks import DigitsMLPFamily


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="file to write (.npz appended unless given)")
    parser.add_argument("--outer-steps", type=int, default=2000)
    parser.add_argument("--time-budget-s", type=float, default=540.0)
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--meta-learning-rate", type=float, default=3e-3)
    parser.add_argument("--std", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    family = DigitsMLPFamily(widths=(32,), depths=(1, 2), activations=("relu", "tanh"))
    horizon, truncation = 200, 50
    start = LearnedOptimizer()
    start = LearnedOptimizer(start.rule, start.init(jax.random.PRNGKey(args.seed)), train_horizon=horizon)
    began = time.monotonic()
    trained = start.meta_train(
        family, args.outer_steps, estimator="pes", num_tasks=args.num_tasks, horizon=horizon,
        truncation_length=truncation, std=args.std, meta_learning_rate=args.meta_learning_rate,
        seed=args.seed, live_plot=False, time_budget_s=args.time_budget_s)
    seconds = time.monotonic() - began
    steps_done = len(trained.history["step"])

    # Held-out check: new instances (seed 12345) of every structure, mean loss of the last 10 steps.
    final = {}
    for name, optimizer in (("prior", start), ("trained", trained)):
        final[name] = float(np.mean([optimizer.train_curves(task, horizon, 4, seed=12345)[:, -10:].mean()
                                     for task in family.tasks()[::3]]))
    print(f"held-out final loss: momentum prior {final['prior']:.4f}, meta-trained {final['trained']:.4f}")
    losses = trained.history["outer_loss"]

    def number(value: float) -> float | None:  # JSON has no NaN: a diverged figure is stored as null
        return float(value) if np.isfinite(value) else None

    trained.info = {
        "command": "python -m carlskit.lopt.train_pretrained " + " ".join(sys.argv[1:] if argv is None else argv),
        "family": repr(family), "estimator": "pes", "horizon": horizon, "truncation_length": truncation,
        "num_tasks": args.num_tasks, "std": args.std, "meta_learning_rate": args.meta_learning_rate,
        "seed": args.seed, "outer_steps": steps_done, "seconds": round(seconds, 1),
        "outer_loss_first_50": number(np.mean(losses[:50])), "outer_loss_last_50": number(np.mean(losses[-50:])),
        "heldout_final_loss_prior": number(final["prior"]), "heldout_final_loss_trained": number(final["trained"]),
        "jax_version": jax.__version__,
    }
    path = trained.save(None, args.out)
    print(f"wrote {path} after {steps_done} outer steps in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
