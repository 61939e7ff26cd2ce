"""The evaluation protocol of issue 30: a learned optimizer against Adam at its best learning rate.

Problems: ``evaluation_problems()``, 13 problems from families the shipped optimizer never saw in
meta-training (the eight of ``held_out_problems()`` plus a deep linear network, a low-rank matrix
completion, a wine autoencoder, a small wine classifier and a linear diabetes fit), fixed before any
further meta-training. Each at the meta-training horizon and at 5x it; Adam's rate tuned on 4 other
instances over 1e-4 .. 1e-1 (half decades, widened while the best rate sits at an edge); both final
losses (mean of the last 10 steps over 8 instances) floored at 1e-3 of the initial loss. The bar
(issue 30): ratio <= 1 on >= 80% of cases, none above 1.25, geometric mean <= 0.7.

    python benchmarks/lopt_heldout.py [--small] [--seed 0] [--optimizer path.npz] [--out table.json]

``--small``: three problems at 1x only (a quick check of the script, not a verdict).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from carlskit.lopt import LearnedOptimizer, compare_at_horizons, evaluation_problems, summarize_comparison

SMALL_PROBLEMS = ("least squares dim 64, condition 1000", "deep linear net 16x4", "wine MLP 8 elu, batch 16")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", default=os.environ.get("CARLSKIT_SMALL") == "1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the evaluation instances")
    parser.add_argument("--optimizer", default=None, help="a saved LearnedOptimizer (.npz); default: the shipped one")
    parser.add_argument("--out", default=None, help="write the rows and the verdict as JSON here")
    args = parser.parse_args()
    lopt = LearnedOptimizer.pretrained() if args.optimizer is None else LearnedOptimizer.load(args.optimizer)
    horizon = lopt.train_horizon or 200
    problems = evaluation_problems()
    if args.small:
        problems = {name: problems[name] for name in SMALL_PROBLEMS}
    multiples = (1,) if args.small else (1, 5)
    started = time.perf_counter()
    rows = []
    for name, task in problems.items():
        for row in compare_at_horizons(lopt, {name: task}, horizon, multiples, seed=args.seed):
            rows.append(row)
            print(f"{row['problem']:42s} {row['horizon']:5d} steps  learned {row['learned']:.3e}  "
                  f"Adam {row['tuned_adam']:.3e} (lr {row['adam_learning_rate']:.0e}"
                  f"{'' if row['rate_inside_grid'] else ', AT GRID EDGE'})  ratio {row['ratio']:.3f}", flush=True)
    verdict = summarize_comparison(rows)
    per_multiple = {f"x{m}": summarize_comparison([r for r in rows if r["multiple"] == m]) for m in multiples}
    result = {"benchmark": "lopt_heldout", "optimizer": args.optimizer or "shipped", "train_horizon": horizon,
              "seed": args.seed, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in verdict.items()},
              "meets_bar": bool(verdict["at_or_below_adam"] >= 0.8 and verdict["worse_than_allowed"] == 0
                                and verdict["geomean"] <= 0.7),
              "per_multiple": per_multiple, "seconds": round(time.perf_counter() - started, 1),
              "load_average_1min": round(os.getloadavg()[0], 2), "small": args.small}
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"rows": rows, "result": result}, file, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
