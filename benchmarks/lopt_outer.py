"""PES outer steps per second: MLP learned optimizer, 4 tasks, truncation 50, 8x8-image MLP task.

The setting of learned_optimization's reference figure (13 PES outer steps/s on a Colab
accelerator): each outer step unrolls 4 antithetic pairs (8 inner trainings, vmapped) for 50 inner
steps of the digits MLP (64-32-10, batch 128) and applies Adam to the meta-parameters.

On CPU one XLA program of this size keeps only about 1.5 of 2 cores busy (user+sys CPU time / wall
time 1.47 on one device, 1.78 split over two), so the script asks for 2 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``, set here before JAX starts unless
XLA_FLAGS already names a device count) and ``make_pes_estimator`` splits the 4 pairs over them
(2 per device, its default). Timed in the same process, interleaved: the estimator split over the
devices (the headline ``pes_outer_steps_per_s``), the same estimator on one device
(``pes_one_device_steps_per_s``), and the pairs run one task at a time in a Python loop (baseline).
Figures are medians over the repeats; the 1-minute load average is printed with them.

Measured on the 2-core machine (2026-11-29, shared; medians of 5): split 14.7 /s at load 2.0 and
18.2 /s at load 1.7 (one device in the same runs: 9.8 and 10.2, i.e. 1.51x and 1.78x; the script
before this change, run interleaved: 9.1 and 9.7); at load 3.3-3.7 (another engineer's job using
2 cores) 8.0-8.1 /s against 4.6-6.4 on one device. Details: docs/notes/pes2_benchmarks.md.

Cluster PES (issue 30): ``cluster_pes_steps_per_s_1`` / ``_2`` and ``cluster_pes_2_over_1``, the
same PES outer step run by 1 and 2 ES workers of ``MetaTraining(estimator="pes")`` (each a Dask
worker process, the learner in a third), counted as estimates the learner received per second.
They come from ``benchmarks/meta_cluster.py --pes-only`` in a subprocess (its Dask workers must not
import this script's JAX before carlskit configures them); ``--no-cluster`` skips them.

    python benchmarks/lopt_outer.py [--small] [--no-cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if HOST_DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {HOST_DEVICES_FLAG}=2".strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import optax  # noqa: E402

from carlskit.lopt import DigitsMLPTask, MLPUpdateRule, make_pes_estimator, task_mesh  # noqa: E402

REFERENCE_STEPS_PER_S = 13.0
REPEATS = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", default=os.environ.get("CARLSKIT_SMALL") == "1")
    parser.add_argument("--no-cluster", action="store_true", help="skip the cluster PES figures")
    args = parser.parse_args()
    outer_steps = 2 if args.small else 8
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}: {len(jax.local_devices())} local devices", flush=True)

    rule = MLPUpdateRule()
    task = DigitsMLPTask((32,), "relu", 128)
    meta_params = rule.init_meta_params(jax.random.PRNGKey(0))
    meta_optimizer = optax.adam(1e-3)

    @jax.jit
    def meta_update(grad, meta_state, theta):
        updates, meta_state = meta_optimizer.update(grad, meta_state, theta)
        return optax.apply_updates(theta, updates), meta_state

    class Run:
        """PES meta-training with ``num_tasks`` pairs vmapped; ``calls`` estimator calls per outer step."""

        def __init__(self, num_tasks: int, calls: int, seed: int, devices=None):
            self.estimator = make_pes_estimator(rule, task, num_tasks=num_tasks, horizon=200, truncation_length=50,
                                                devices=devices)
            self.calls, self.theta, self.meta_state = calls, meta_params, meta_optimizer.init(meta_params)
            self.state = self.estimator.init(meta_params, jax.random.PRNGKey(seed))
            self.key = jax.random.PRNGKey(seed + 1)
            self.steps_per_s(1)  # warm-up (compile)

        def steps_per_s(self, steps: int) -> float:
            start = time.perf_counter()
            for _ in range(steps * self.calls):
                self.key, step_key = jax.random.split(self.key)
                grad, self.state, _ = self.estimator.gradient(self.theta, step_key, self.state)
                self.theta, self.meta_state = meta_update(grad, self.meta_state, self.theta)
            jax.block_until_ready(self.theta)
            return steps / (time.perf_counter() - start)

    mesh = task_mesh(4)
    split_devices = 1 if mesh is None else mesh.devices.size
    vectorized_run = Run(4, 1, 0)  # default: pairs split over the local devices
    one_device_run = Run(4, 1, 0, devices=jax.local_devices()[:1])
    # Baseline: one pair at a time (num_tasks=1, one device), 4 calls per outer step.
    one_pair_run = Run(1, 4, 4)
    vectorized_rates, one_device_rates, one_pair_rates, loads = [], [], [], []
    for repeat in range(REPEATS):  # interleaved (the machine is shared); medians reported
        vectorized_rates.append(vectorized_run.steps_per_s(outer_steps))
        one_device_rates.append(one_device_run.steps_per_s(outer_steps))
        one_pair_rates.append(one_pair_run.steps_per_s(max(1, outer_steps // 2)))
        loads.append(os.getloadavg()[0])
        print(f"repeat {repeat}: PES 4 tasks vmapped over {split_devices} devices {vectorized_rates[-1]:.2f} "
              f"outer steps/s, on one device {one_device_rates[-1]:.2f}, one task at a time "
              f"{one_pair_rates[-1]:.2f} (load {loads[-1]:.2f})", flush=True)
    vectorized, one_pair = float(np.median(vectorized_rates)), float(np.median(one_pair_rates))
    one_device = float(np.median(one_device_rates))
    result = {
        "benchmark": "lopt_outer",
        "setting": "PES, MLPUpdateRule hidden (32, 32), 4 tasks, truncation 50, digits 8x8 MLP 64-32-10 batch 128",
        "repeats": REPEATS,
        "pes_outer_steps_per_s": round(vectorized, 2),
        "pes_outer_steps_per_s_best": round(max(vectorized_rates), 2),
        "reference_steps_per_s": REFERENCE_STEPS_PER_S,
        "ratio_to_reference": round(vectorized / REFERENCE_STEPS_PER_S, 3),
        "devices": split_devices,
        "pes_one_device_steps_per_s": round(one_device, 2),
        "devices_over_one_device": round(vectorized / one_device, 2),
        "one_task_at_a_time_steps_per_s": round(one_pair, 2),
        "vectorized_over_loop": round(vectorized / one_pair, 2),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "device": str(jax.devices()[0].platform),
        "small": args.small,
    }
    if not args.no_cluster:
        result.update(cluster_pes(args.small))
    print(json.dumps(result))


def cluster_pes(small: bool) -> dict:
    """``benchmarks/meta_cluster.py --pes-only`` in a subprocess: its last line is the JSON figures."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "meta_cluster.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # workers: one host device each
    print("cluster PES (1 and 2 ES workers) ...", flush=True)
    done = subprocess.run([sys.executable, script, "--pes-only", *(["--small"] if small else [])], env=env,
                          capture_output=True, text=True, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: v for k, v in figures.items() if k.startswith("cluster_pes")}


if __name__ == "__main__":
    main()
