"""Accuracy of the bank-served GNN (issue 28, ``carlskit.paradigms.gnn``) against the full-graph GCN
with the same encoder and the MLP, mean of seeds; validation-selected checkpoints.

    python benchmarks/gnn_accuracy.py [--data cora citeseer sbm0.6 sbm0.9] [--seeds 0 1 2] [--refresh]

``sbm0.6`` / ``sbm0.9``: ``carlskit.data.synthetic_planetoid`` graphs of homophily 0.6 / 0.9 (seed =
the run's seed, default size and feature signal). ``--refresh`` also trains the GNN with the graph
refreshed from its embeddings (a neighbour maker adding each node's ``refresh_k`` nearest by cosine on
the latest hidden embeddings, weight ``refresh_mix``; the given neighbours keep 1 - refresh_mix).
Per run a line on stderr; last line on stdout: JSON with every run and the means.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

import numpy as np

from carlskit.data import load_planetoid, synthetic_planetoid
from carlskit.paradigms import gnn


def load(name: str, seed: int):
    if name.startswith("sbm"):
        return synthetic_planetoid(homophily=float(name[3:]), seed=seed)
    return load_planetoid(name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", nargs="+", default=["cora", "citeseer", "sbm0.6", "sbm0.9"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--refresh", action="store_true", help="also the GNN on the refreshed graph")
    parser.add_argument("--refresh-k", type=int, default=8)
    parser.add_argument("--refresh-mix", type=float, default=0.3)
    args = parser.parse_args()
    config = gnn.GNNConfig()
    runs = []
    for name in args.data:
        for seed in args.seeds:
            data = load(name, seed)
            row = {**gnn.compare(data, config, seed=seed), "data": name, "seed": seed}
            row.pop("config")
            if args.refresh:
                refreshed = gnn.train_bank_gnn(data, replace(config, refresh_k=args.refresh_k,
                                                             refresh_mix=args.refresh_mix), seed=seed)
                row["refreshed_test_acc"], row["refreshed_val_acc"] = refreshed["test_acc"], refreshed["val_acc"]
            runs.append(row)
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))}), file=sys.stderr,
                  flush=True)
    fields = ["base_test_acc", "gcn_test_acc", "gnn_test_acc"] + (["refreshed_test_acc"] if args.refresh else [])
    means = {name: {field: float(np.mean([r[field] for r in runs if r["data"] == name])) for field in fields}
             for name in args.data}
    print(json.dumps({"means": means, "seeds": args.seeds, "config": asdict(gnn.GNNConfig()),
                      "refresh": {"k": args.refresh_k, "mix": args.refresh_mix} if args.refresh else None,
                      "load": os.getloadavg()[0], "runs": runs}))


if __name__ == "__main__":
    main()
