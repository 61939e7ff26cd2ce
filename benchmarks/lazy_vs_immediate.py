"""Two trainers sharing the bank's skip-gram tables: the lazy update (mean or sum of a row's cached
gradients) against immediate application, at equal samples, on the same seeds and learning rates.

Each configuration trains ``carlskit.paradigms.node_embeddings`` with 2 trainers on 2 Dask workers
(each on the walks of its half of the nodes, both tables in the bank, Adagrad) for ``--epochs`` of
its pairs, and reports the final loss per pair (mean of each trainer's last 20 steps, averaged over
the trainers) and the test accuracy of the logistic regression:

- ``immediate``: ``max_pending=1``, each gradient applied by the table's Adagrad when it arrives;
- ``lazy_mean``: ``max_pending=16``, a row's gradients cached until its next lookup, outliers dropped,
  averaged, one Adagrad step (the bank's default ``combine="mean"``);
- ``lazy_sum``: the same, summed (``combine="sum"``), the rule for a loss that is a sum over pairs.

Every learning rate of ``--learning-rates`` runs for every variant and seed (the same grid for all);
the summary picks each variant's best rate by mean final loss over the seeds. ``--optimizer sgd``
gives both tables plain SGD instead of Adagrad (the issue's "immediate SGD" baseline, literally).

    python benchmarks/lazy_vs_immediate.py [--data cora] [--seeds 0 1] [--epochs 0.3]
        [--learning-rates 0.05 0.1] [--variants immediate lazy_mean lazy_sum] [--optimizer adagrad|sgd] [--small]
One JSON line per run, then a last line: the summary (best rate and mean final loss per variant,
``lazy_mean_over_immediate_loss`` and ``lazy_sum_over_immediate_loss`` at each one's best rate).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import numpy as np

from carlskit.cluster import connect
from carlskit.data import load_planetoid
from carlskit.paradigms import node_embeddings as ne

VARIANTS = {"immediate": dict(max_pending=1), "lazy_mean": dict(max_pending=16, combine="mean"),
            "lazy_sum": dict(max_pending=16, combine="sum")}


def final_loss(losses: list[list[float]]) -> float:
    return float(np.mean([np.mean(trainer[-20:]) for trainer in losses]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="cora")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=float, default=0.3)
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[0.05, 0.1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--optimizer", default="adagrad", choices=["adagrad", "sgd"])
    parser.add_argument("--small", action="store_true", help="0.02 epochs, one seed, one rate")
    args = parser.parse_args()
    if args.small or os.environ.get("CARLSKIT_SMALL") == "1":
        args.epochs, args.seeds, args.learning_rates = 0.02, args.seeds[:1], args.learning_rates[:1]
    data = load_planetoid(args.data)
    client = connect(n_workers=2, threads_per_worker=1)
    runs = []
    try:
        for seed in args.seeds:
            for rate in args.learning_rates:
                for variant in args.variants:
                    config = replace(ne.NodeEmbeddingConfig(), epochs=args.epochs, learning_rate=rate,
                                     optimizer=args.optimizer, **VARIANTS[variant])
                    result = ne.train(data, config, seed=seed, client=client, num_shards=2, trainers=2)
                    run = {"variant": variant, "seed": seed, "learning_rate": rate, "samples": result["samples"],
                           "final_loss": final_loss(result["losses"]), "test_acc": result["test_acc"],
                           "train_seconds": result["train_seconds"], "load": os.getloadavg()[0]}
                    runs.append(run)
                    print(json.dumps(run), flush=True)
    finally:
        client.close()
    summary = {"data": args.data, "optimizer": args.optimizer, "seeds": args.seeds, "epochs_per_trainer": args.epochs,
               "samples": runs[0]["samples"], "learning_rates": args.learning_rates}
    for variant in args.variants:
        by_rate = {rate: [r for r in runs if r["variant"] == variant and r["learning_rate"] == rate]
                   for rate in args.learning_rates}
        best = min(by_rate, key=lambda rate: np.mean([r["final_loss"] for r in by_rate[rate]]))
        summary[variant] = {"best_learning_rate": best,
                            "final_loss": float(np.mean([r["final_loss"] for r in by_rate[best]])),
                            "test_acc": float(np.mean([r["test_acc"] for r in by_rate[best]])),
                            "final_loss_per_seed": [r["final_loss"] for r in by_rate[best]]}
    for lazy in ("lazy_mean", "lazy_sum"):  # each at its best rate: <= 1 is the bar
        if "immediate" in summary and lazy in summary:
            summary[f"{lazy}_over_immediate_loss"] = summary[lazy]["final_loss"] / summary["immediate"]["final_loss"]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
