"""How ``NominalAdamRule``'s defaults (``learning_rate=3e-2``, ``schedule="linear"``) were chosen.

The untrained rule is ``optax.adam(schedule(learning_rate, num_steps))`` and is where a meta-training
campaign starts. This sweep scores every (schedule, rate) on the *meta-training* distribution only:
``structures`` distinct structures drawn (``seed``) from ``wide_meta_training_family()``'s mixture,
each at 200 and 1000 steps on 4 instances, scored as the campaign's validation is: the geometric
mean of final loss / Adam's final loss at its best constant rate of the same grid (half decades
3e-4 .. 1e-1), both floored at 1e-3 of the initial loss. ``--validation`` also prints the untrained
rule's per-problem ratios on ``validation_problems()`` under the former and the chosen defaults
(a report only: the choice never looks at them). About 12 minutes on one loaded core.

    python benchmarks/nominal_defaults.py [--structures 8] [--seed 0] [--validation]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

from carlskit.lopt import LearnedOptimizer, NominalAdamRule, wide_meta_training_family
from carlskit.lopt._campaign import FLOOR_FRACTION, Campaign, CampaignConfig
from carlskit.lopt._optimizer import final_loss, tuned_learning_rate

RATES = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
HORIZONS = (200, 1000)
SCHEDULES = {"constant": lambda lr, n: lr, "cosine": lambda lr, n: optax.cosine_decay_schedule(lr, n),
             "linear": lambda lr, n: optax.linear_schedule(lr, 0.0, n)}


def structures(count: int, seed: int) -> list:
    """``count`` distinct structures drawn from the wide meta-training mixture (unrescaled)."""
    family, rng, picked = wide_meta_training_family().family, np.random.default_rng(seed), []
    while len(picked) < count:
        task = family.sample(rng)
        if task not in picked:
            picked.append(task)
    return picked


def sweep(tasks: list) -> dict[str, np.ndarray]:
    """``{schedule: ratios[rate, task x horizon]}``: floored final loss over tuned constant Adam's."""
    makers = {(name, n): (lambda lr, s=schedule, n=n: optax.adam(s(lr, n)))
              for name, schedule in SCHEDULES.items() for n in HORIZONS}  # one compiled grid per pair
    finals, initial = {name: [] for name in SCHEDULES}, []
    for task in tasks:
        for n in HORIZONS:
            for name in SCHEDULES:
                _, curves = tuned_learning_rate(makers[name, n], task, RATES, n, 4, 2000)
                finals[name].append(np.nan_to_num(curves[:, :, -10:].mean(axis=(1, 2)), nan=np.inf))
            initial.append(curves[0, :, 0].mean())
    floor = FLOOR_FRACTION * np.asarray(initial)
    reference = np.maximum(np.min(np.stack(finals["constant"]), axis=1), floor)
    return {name: np.maximum(np.stack(f).T, floor) / reference for name, f in finals.items()}


def validation_ratios(rules: dict[str, NominalAdamRule]) -> tuple[list[str], dict[str, np.ndarray]]:
    """Each untrained rule's ratios on the campaign's validation problems, by its own protocol."""
    campaign = Campaign(CampaignConfig())
    config = campaign.config
    names, references, finals = [], [], {label: [] for label in rules}
    for name, task in campaign.validation.items():
        for multiple in config.validation_multiples:
            steps = config.base_horizon * multiple
            reference, initial = campaign.adam_reference(task, steps, 3000)
            names.append(f"{name} @{steps}")
            references.append(max(reference, FLOOR_FRACTION * initial))
            for label, rule in rules.items():
                lopt = LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(0)))
                final = final_loss(lopt.train_curves(task, steps, config.baseline_instances, 3000))
                finals[label].append(max(final, FLOOR_FRACTION * initial))
    return names, {label: np.asarray(f) / np.asarray(references) for label, f in finals.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--structures", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validation", action="store_true", help="also report the validation problems' ratios")
    args = parser.parse_args()
    tasks = structures(args.structures, args.seed)
    print("meta-training structures:", *map(repr, tasks), sep="\n  ")
    scores = sweep(tasks)
    print("geometric mean ratio by schedule and rate:\n" + f"{'':10s}" + "".join(f"{r:>9g}" for r in RATES))
    for name, ratios in scores.items():
        print(f"{name:10s}" + "".join(f"{np.exp(np.mean(np.log(row))):9.3f}" for row in ratios))
    if args.validation:
        names, ratios = validation_ratios({"former: cosine 3e-3": NominalAdamRule(3e-3, "cosine"),
                                           "default: linear 3e-2": NominalAdamRule()})
        for label, values in ratios.items():
            print(f"validation, {label}: geomean {np.exp(np.mean(np.log(values))):.3f}")
            for name, ratio in zip(names, values):
                print(f"  {name:55s} {ratio:8.2f}")


if __name__ == "__main__":
    main()
