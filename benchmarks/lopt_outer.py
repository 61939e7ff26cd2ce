"""PES outer steps per second: MLP learned optimizer, 4 tasks, truncation 50, 8x8-image MLP task.

The setting of learned_optimization's reference figure (13 PES outer steps/s on a Colab
accelerator): each outer step unrolls 4 antithetic pairs (8 inner trainings, vmapped) for 50 inner
steps of the digits MLP (64-32-10, batch 128) and applies Adam to the meta-parameters. Also times
the same estimator with the pairs run one task at a time in a Python loop (baseline, same process).
Figures are medians over interleaved repeats; the 1-minute load average is printed with them.

    python benchmarks/lopt_outer.py [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np
import optax

from carlskit.lopt import DigitsMLPTask, MLPUpdateRule, make_pes_estimator

REFERENCE_STEPS_PER_S = 13.0
REPEATS = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", default=os.environ.get("CARLSKIT_SMALL") == "1")
    args = parser.parse_args()
    outer_steps = 2 if args.small else 8

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

        def __init__(self, num_tasks: int, calls: int, seed: int):
            self.estimator = make_pes_estimator(rule, task, num_tasks=num_tasks, horizon=200, truncation_length=50)
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

    vectorized_run = Run(4, 1, 0)
    # Baseline: one pair at a time (num_tasks=1), 4 calls per outer step.
    one_pair_run = Run(1, 4, 4)
    vectorized_rates, one_pair_rates = [], []
    for repeat in range(REPEATS):  # interleaved (the machine is shared); medians reported
        vectorized_rates.append(vectorized_run.steps_per_s(outer_steps))
        one_pair_rates.append(one_pair_run.steps_per_s(max(1, outer_steps // 2)))
        print(f"repeat {repeat}: PES 4 tasks vmapped {vectorized_rates[-1]:.2f} outer steps/s, "
              f"one task at a time {one_pair_rates[-1]:.2f}", flush=True)
    vectorized, one_pair = float(np.median(vectorized_rates)), float(np.median(one_pair_rates))
    result = {
        "benchmark": "lopt_outer",
        "setting": "PES, MLPUpdateRule hidden (32, 32), 4 tasks, truncation 50, digits 8x8 MLP 64-32-10 batch 128",
        "repeats": REPEATS,
        "pes_outer_steps_per_s": round(vectorized, 2),
        "pes_outer_steps_per_s_best": round(max(vectorized_rates), 2),
        "reference_steps_per_s": REFERENCE_STEPS_PER_S,
        "ratio_to_reference": round(vectorized / REFERENCE_STEPS_PER_S, 3),
        "one_task_at_a_time_steps_per_s": round(one_pair, 2),
        "vectorized_over_loop": round(vectorized / one_pair, 2),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "device": str(jax.devices()[0].platform),
        "small": args.small,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
