"""Embedding tables trained through the bank (``carlskit.training.BankEmbeddings``) against an
in-device ``nnx.Embed``, with one and two trainers, and with a table 100x larger.

- ``bank_embed_vs_nnx``: trainer steps per second (wall time of ``fit``, pipeline and gradient push
  included) of the skip-gram model of ``carlskit.paradigms.node_embeddings`` with both tables in the
  bank over the same model with two ``nnx.Embed`` of the same rows trained by optax (Adagrad both),
  100k rows of dim 64, batches of 4096 pairs with 5 negatives (ids drawn with a Zipf-like skew).
- ``two_trainers_over_one``: samples per second of 2 trainers, each on its own Dask worker that
  also holds one of the bank's 2 shards, over 1 trainer on one worker holding both shards; every
  worker process pinned to one core of its own and single-threaded, so each trainer brings one core
  (weak scaling). Steady state: the samples of the steps that ended between step 30 and the first
  trainer's last step, by the records' ``wall_time`` (process start, shipping, compilation and
  first lookups excluded); median of 3 interleaved rounds of 150 steps per trainer. Beside it
  ``two_trainers_over_one_shared_cores``: the same with the workers unpinned and both shards spread
  over both workers in both runs (one trainer may then use every core: strong scaling on a fixed machine).
- ``step_10m_over_100k``: the wall time per step with a 10,000,000-row table over a 100,000-row
  table (dim 32, ids uniform over the table, the rows written first, one trainer in-process).
- ``bytes_per_row_ratio``: the bank's resident bytes per row (values, Adagrad accumulator, per-row
  metadata, key map) over the raw float32 row plus its optimizer state (2 * 4 * dim), dim 64.

    python benchmarks/dynamic_embedding.py [--small] [--skip-cluster | --only-cluster]
Last line: one JSON object with those keys and the times behind them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from carlskit.bank import KnowledgeBank
from carlskit.cluster import live_workers
from carlskit.paradigms.node_embeddings import NodeEmbeddingConfig, make_trainer, skip_gram_loss
from carlskit.training import Trainer

DIM, BATCH, NEGATIVES = 64, 4096, 5


class EmbedSkipGram(nnx.Module):
    """The skip-gram model with both tables in-device (``nnx.Embed``)."""

    def __init__(self, rows: int, dim: int):
        self.nodes = nnx.Embed(rows, dim, rngs=nnx.Rngs(0))
        self.contexts = nnx.Embed(rows, dim, rngs=nnx.Rngs(1))

    def __call__(self, batch):
        centre = self.nodes(batch["centre"])
        positive = jnp.sum(centre * self.contexts(batch["context"]), axis=-1)
        negative = jnp.einsum("bd,bkd->bk", centre, self.contexts(batch["negatives"]))
        return positive, negative


class Batches:
    """f(step) -> skip-gram batch of ids in [0, rows), skewed (rank ~ u^3 * rows) like node degrees."""

    def __init__(self, rows: int, seed: int = 0, skew: bool = True):
        self.rows, self.rng, self.skew = rows, np.random.default_rng(seed), skew

    def ids(self, shape):
        u = self.rng.random(shape)
        return ((u ** 3 if self.skew else u) * self.rows).astype(np.int64)

    def __call__(self, step):
        return {"centre": self.ids(BATCH), "context": self.ids(BATCH), "negatives": self.ids((BATCH, NEGATIVES))}


def bank_trainer(bank: KnowledgeBank, rows: int, dim: int = DIM, optimizer: str = "adagrad") -> Trainer:
    cfg = NodeEmbeddingConfig(dim=dim, batch_size=BATCH, negatives=NEGATIVES)
    for table in ("nodes", "contexts"):
        if table not in bank.tables:
            bank.create_table(table, dim, initializer="zeros" if rows > 1_000_000 else "normal",
                              optimizer=optimizer, learning_rate=0.05, capacity=rows)
    return make_trainer(bank, cfg, rows)


def seconds_per_step(trainer: Trainer, data, steps: int, warmup: int) -> float:
    trainer.fit(data, warmup, progress=False, live=False)
    start = time.perf_counter()
    trainer.fit(data, steps, progress=False, live=False)
    return (time.perf_counter() - start) / steps


def bank_vs_nnx(rows: int, steps: int, rounds: int) -> dict:
    bank = KnowledgeBank()
    trainer = bank_trainer(bank, rows)
    bank.lookup("nodes", np.arange(rows), insert_missing=True)
    bank.lookup("contexts", np.arange(rows), insert_missing=True)
    peer = Trainer(EmbedSkipGram(rows, DIM), optax.adagrad(0.05), skip_gram_loss)
    times = {"bank": [], "nnx": []}
    for _ in range(rounds):  # interleaved: load changes hit both alike
        times["bank"].append(seconds_per_step(trainer, Batches(rows, 1), steps, 3))
        times["nnx"].append(seconds_per_step(peer, Batches(rows, 1), steps, 3))
    bank_s, nnx_s = float(np.median(times["bank"])), float(np.median(times["nnx"]))
    stats = bank.stats()["tables"]["nodes"]
    raw = 2 * 4 * DIM  # float32 row + Adagrad accumulator
    bank.close()
    return {"bank_seconds_per_step": bank_s, "nnx_seconds_per_step": nnx_s, "bank_embed_vs_nnx": nnx_s / bank_s,
            "bytes_per_row": stats["resident_bytes"] / stats["rows"], "raw_bytes_per_row": raw,
            "bytes_per_row_ratio": stats["resident_bytes"] / stats["rows"] / raw}


def large_over_small(small_rows: int, large_rows: int, steps: int) -> dict:
    out = {}
    for rows in (small_rows, large_rows):
        bank = KnowledgeBank()
        trainer = bank_trainer(bank, rows, dim=32, optimizer="sgd")
        chunk = 1 << 20
        for start in range(0, rows, chunk):  # every row present, as in a trained table
            keys = np.arange(start, min(rows, start + chunk))
            for table in ("nodes", "contexts"):
                bank.lookup(table, keys, insert_missing=True)
        out[rows] = seconds_per_step(trainer, Batches(rows, 2, skew=False), steps, 3)
        bank.close()
    return {"seconds_per_step_small": out[small_rows], "seconds_per_step_large": out[large_rows],
            "small_rows": small_rows, "large_rows": large_rows,
            "step_10m_over_100k": out[large_rows] / out[small_rows]}


def pin_to_cores(cores: list[int]) -> list[int]:
    """Pin every thread of this process to ``cores`` (threads started later inherit it): pinned to
    one core, a worker process has one core's worth of CPU, whatever threads XLA, NumPy or Dask start."""
    for thread in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(thread, set(cores))
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(os.sched_getaffinity(0))


def steady_samples_per_second(trainers: list[Trainer], warmup: int) -> float:
    """Samples per second of ``trainers`` together, from their records' ``wall_time``: the steps
    that ended inside the window where all were past step ``warmup`` and none had finished (process
    start, shipping, compilation and the first lookups are outside it)."""
    start = max(t.history[warmup - 1]["wall_time"] for t in trainers)
    end = min(t.history[-1]["wall_time"] for t in trainers)
    if end <= start:
        raise RuntimeError("the trainers' steady states did not overlap: give them more steps")
    steps = sum(sum(start < r["wall_time"] <= end for r in t.history) for t in trainers)
    return steps * BATCH / (end - start)


def trainers_scaling(rows: int, steps: int, rounds: int, warmup: int) -> dict:
    """Samples/s of 1 and 2 trainers (steady state, median of interleaved rounds), two ways:

    - ``pinned`` (the key ``two_trainers_over_one``): every worker process pinned to a core of its
      own and single-threaded (``threads_per_worker=1``: XLA without its Eigen pool, OpenMP/BLAS 1);
      1 trainer on one worker holding both bank shards against 2 trainers on two workers holding a
      shard each: each trainer brings one core (weak scaling);
    - ``shared``: the workers unpinned, both shards on both workers in both runs: 1 trainer may use
      every core of the machine (its worker and the other worker's shard), 2 trainers share them.
    """
    from carlskit.cluster import connect

    client = connect(n_workers=2, threads_per_worker=1)
    try:
        workers = sorted(live_workers(client))
        cores = sorted(os.sched_getaffinity(0))
        flags = set(client.run(lambda: os.environ.get("XLA_FLAGS", "")).values())
        rates: dict[str, dict[int, list[float]]] = {"pinned": {1: [], 2: []}, "shared": {1: [], 2: []}}
        for _ in range(rounds):
            for mode in rates:
                for i, w in enumerate(workers):
                    client.run(pin_to_cores, [cores[i % len(cores)]] if mode == "pinned" else cores, workers=[w])
                for count in (1, 2):
                    bank = KnowledgeBank(client, num_shards=2, workers=workers[:count] if mode == "pinned" else None)
                    trainers = [bank_trainer(bank, rows) for _ in range(count)]
                    handles = [t.fit(Batches(rows, 10 + i), steps, client=client, workers=[w], block=False,
                                     progress=False, live=False) for i, (t, w) in enumerate(zip(trainers, workers))]
                    for handle in handles:
                        handle.wait()
                    rates[mode][count].append(steady_samples_per_second(trainers, warmup))
                    bank.close()
    finally:
        client.close()
    median = {mode: {count: float(np.median(v)) for count, v in by.items()} for mode, by in rates.items()}
    return {"samples_per_second_1": median["pinned"][1], "samples_per_second_2": median["pinned"][2],
            "two_trainers_over_one": median["pinned"][2] / median["pinned"][1],
            "shared_samples_per_second_1": median["shared"][1], "shared_samples_per_second_2": median["shared"][2],
            "two_trainers_over_one_shared_cores": median["shared"][2] / median["shared"][1],
            "scaling_rounds": {mode: {str(k): v for k, v in by.items()} for mode, by in rates.items()},
            "cores": cores, "worker_xla_flags": sorted(flags)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: checks the script runs")
    parser.add_argument("--skip-cluster", action="store_true", help="no Dask workers (two_trainers_over_one)")
    parser.add_argument("--only-cluster", action="store_true", help="only two_trainers_over_one")
    args = parser.parse_args()
    small = args.small or os.environ.get("CARLSKIT_SMALL") == "1"
    rows = 2_000 if small else 100_000
    result = {"rows": rows, "dim": DIM, "batch": BATCH, "negatives": NEGATIVES, "small": small,
              "devices": [d.device_kind for d in jax.devices()], "load": os.getloadavg()}
    if not args.only_cluster:
        result.update(bank_vs_nnx(rows, 5 if small else 30, 1 if small else 3))
        result.update(large_over_small(rows, 20_000 if small else 10_000_000, 5 if small else 30))
    if not args.skip_cluster:
        result.update(trainers_scaling(rows, 40 if small else 150, 1 if small else 3, 5 if small else 30))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
