"""Meta-training cluster (issue 8): outer gradients per second with 1 and 2 ES workers, the fraction
of gradients dropped as stale for ``max_staleness`` 0, 1 and 5, and the learner's overhead per update.

Baseline measured in the same process: the same ES estimator called in a loop here, with no cluster
(``grads_per_s_in_process``). Each cluster figure counts the gradients the learner *received* during
a window after warm-up (compilation on the workers excluded). The embedded cluster has one worker
process for the gradient store and learner plus one per ES worker. The in-process loop and the 1- and
2-worker runs are interleaved (``benchmarks/_timing.py``): ``speedup_2_vs_1_workers`` and
``ratio_1_worker_vs_in_process`` are medians of per-repeat ratios, with ``_spread`` keys beside them.

    python benchmarks/meta_cluster.py [--small]

Prints progress, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import carlskit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleave, ratio  # noqa: E402

# JAX and carlskit.lopt are imported inside the functions: Dask's spawned workers re-import this
# script, and JAX must not start there before carlskit configures the worker.


def wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not met in time")
        time.sleep(0.1)


def in_process_rate(rule, task, num_tasks, num_steps, seconds) -> float:
    import jax

    from carlskit.lopt import make_full_es_estimator

    estimator = make_full_es_estimator(rule, task, num_tasks=num_tasks, num_steps=num_steps)
    theta = rule.init_meta_params(jax.random.PRNGKey(0))
    jax.block_until_ready(estimator(theta, jax.random.PRNGKey(0)))  # compile
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        jax.block_until_ready(estimator(theta, jax.random.PRNGKey(count)))
        count += 1
    return count / (time.perf_counter() - started)


def learner_overhead(rule, gradients_per_update: int, updates: int) -> float:
    """Seconds per learner update (validation, staleness filter, averaging, Adam) in this process."""
    import optax

    from carlskit.lopt import GradientStore, Learner

    with tempfile.TemporaryDirectory() as directory:
        store = GradientStore()
        learner = Learner(rule, store, directory, outer_optimizer=optax.adam(1e-3), checkpoint_every_seconds=1e9)
        shapes = [np.shape(x) for x in learner.current()[1]]
        rng = np.random.default_rng(0)
        grads = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(gradients_per_update)]

        def batch(step):
            return [{"id": f"{step}-{i}", "grad": g, "outer_step": step, "task_family": "bench",
                     "losses": np.zeros((1, 2)), "outer_loss": 1.0, "worker": 0, "seconds": 0.0}
                    for i, g in enumerate(grads)]

        for step in range(3):  # compile
            store.put_many(batch(step))
            learner.update()
        total = 0.0
        for step in range(3, 3 + updates):
            store.put_many(batch(step))
            total += learner.update()["seconds"]
        return total / updates


def cluster_run(client, rule, task, *, num_workers, max_staleness, num_tasks, num_steps, window_seconds,
                warmup_steps=3) -> dict:
    from carlskit.lopt import LearnedOptimizer, MetaTraining

    with tempfile.TemporaryDirectory() as directory:
        training = MetaTraining(LearnedOptimizer(rule), task, client, directory=directory, num_workers=num_workers,
                                num_tasks=num_tasks, num_steps=num_steps, max_staleness=max_staleness,
                                checkpoint_every_seconds=600.0, evaluate=False).start()
        try:
            wait_for(lambda: (training.learner_status().get("received") or 0) >= warmup_steps * num_workers, 600)
            time.sleep(1.0)  # every worker past its compilation
            before = training.learner_status()
            time.sleep(window_seconds)
            after = training.learner_status()
        finally:
            training.stop()
    received = after["received"] - before["received"]
    dropped = after["dropped_stale"] - before["dropped_stale"]
    return {"grads_per_s": received / window_seconds, "dropped_fraction": dropped / max(received, 1),
            "outer_steps_per_s": (after["outer_step"] - before["outer_step"]) / window_seconds,
            "learner_update_s": (after["update_seconds_total"] - before["update_seconds_total"])
            / max(after["timed_updates"] - before["timed_updates"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="short windows (also CARLSKIT_SMALL=1)")
    args = parser.parse_args()
    small = args.small or os.environ.get("CARLSKIT_SMALL") == "1"
    from carlskit.lopt import MLPUpdateRule, QuadraticTask

    window = 6.0 if small else 20.0
    rule, task = MLPUpdateRule(), QuadraticTask(8, 10.0, 0.1)
    num_tasks, num_steps = 8, 20

    repeats = 2 if small else 3
    overhead = learner_overhead(rule, gradients_per_update=2, updates=20 if small else 100)
    print(f"learner overhead (in process, 2 gradients/update): {overhead * 1e3:.2f} ms", flush=True)

    results: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {"1_worker": [], "2_workers": []}
    client = carlskit.connect(n_workers=3, threads_per_worker=1)  # store+learner worker, 2 ES workers
    try:
        print("warm-up: every worker process compiles the estimator once (not measured) ...", flush=True)
        cluster_run(client, rule, task, num_workers=2, max_staleness=5, num_tasks=num_tasks, num_steps=num_steps,
                    window_seconds=1.0, warmup_steps=5)

        # The compared rates, interleaved (benchmarks/_timing.py): each repeat measures the in-process
        # loop, 1 and 2 ES workers once, windows of window / 2; ratios are formed within a repeat.
        def cluster(name: str, workers: int):
            def run() -> float:  # seconds per received gradient
                runs[name].append(cluster_run(client, rule, task, num_workers=workers, max_staleness=5,
                                              num_tasks=num_tasks, num_steps=num_steps, window_seconds=window / 2))
                print(f"  {name}: {runs[name][-1]}", flush=True)
                return 1.0 / max(runs[name][-1]["grads_per_s"], 1e-9)

            return run

        def in_process() -> float:
            rate = in_process_rate(rule, task, num_tasks, num_steps, window / 4)
            print(f"  in process: {rate:.1f} gradients/s", flush=True)
            return 1.0 / rate

        samples = interleave({"in_process": in_process, "1_worker": cluster("1_worker", 1),
                              "2_workers": cluster("2_workers", 2)}, repeats, warmup=False)
        for name, staleness in (("staleness_0", 0), ("staleness_1", 1)):
            print(f"cluster run {name} ...", flush=True)
            results[name] = cluster_run(client, rule, task, num_workers=2, max_staleness=staleness,
                                        num_tasks=num_tasks, num_steps=num_steps, window_seconds=window)
            print(f"  {results[name]}", flush=True)
    finally:
        client.close()
    for name, measured in runs.items():  # the median repeat's figures
        results[name] = {key: statistics.median(run[key] for run in measured) for key in measured[0]}
    speedup = ratio(samples, "1_worker", "2_workers", "speedup_2_vs_1_workers")
    versus = ratio(samples, "in_process", "1_worker", "ratio_1_worker_vs_in_process")

    report = {
        "benchmark": "meta_cluster", "small": small, "rule": "MLPUpdateRule", "task": repr(task),
        "num_tasks": num_tasks, "num_steps": num_steps, "window_s": window,
        "repeats": repeats, "grads_per_s_in_process": round(1.0 / statistics.median(samples["in_process"]), 2),
        "grads_per_s_1_worker": round(results["1_worker"]["grads_per_s"], 2),
        "grads_per_s_2_workers": round(results["2_workers"]["grads_per_s"], 2),
        **{name: round(value, 3) for name, value in {**speedup, **versus}.items()},
        "dropped_fraction_max_staleness_0": round(results["staleness_0"]["dropped_fraction"], 4),
        "dropped_fraction_max_staleness_1": round(results["staleness_1"]["dropped_fraction"], 4),
        "dropped_fraction_max_staleness_5": round(results["2_workers"]["dropped_fraction"], 4),
        "learner_update_ms_in_process": round(overhead * 1e3, 3),
        "learner_update_ms_cluster": round(results["2_workers"]["learner_update_s"] * 1e3, 3),
        "outer_steps_per_s_2_workers": round(results["2_workers"]["outer_steps_per_s"], 2),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
