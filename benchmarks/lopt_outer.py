"""PES outer steps per second: MLP learned optimizer, 4 tasks, truncation 50, 8x8-image MLP task.

The setting of learned_optimization's reference figure (13 PES outer steps/s on a Colab
accelerator): each outer step unrolls 4 antithetic pairs (8 inner trainings, vmapped) for 50 inner
steps of the digits MLP (64-32-10, batch 128) and applies Adam to the meta-parameters. Also times
the same estimator with the pairs run one task at a time in a Python loop (baseline, same process).

    python benchmarks/lopt_outer.py [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import optax

from carlskit.lopt import DigitsMLPTask, MLPUpdateRule, make_pes_estimator

REFERENCE_STEPS_PER_S = 13.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", default=os.environ.get("CARLSKIT_SMALL") == "1")
    args = parser.parse_args()
    outer_steps = 10 if args.small else 40

    rule = MLPUpdateRule()
    task = DigitsMLPTask((32,), "relu", 128)
    meta_params = rule.init_meta_params(jax.random.PRNGKey(0))
    meta_optimizer = optax.adam(1e-3)

    def run(num_tasks: int, steps: int, seed: int) -> float:
        """Outer steps/s of PES with ``num_tasks`` pairs vmapped (after one warm-up step)."""
        estimator = make_pes_estimator(rule, task, num_tasks=num_tasks, horizon=200, truncation_length=50)
        theta, meta_state = meta_params, meta_optimizer.init(meta_params)
        state = estimator.init(theta, jax.random.PRNGKey(seed))
        key = jax.random.PRNGKey(seed + 1)
        start = None
        for i in range(steps + 1):
            if i == 1:
                jax.block_until_ready(theta)
                start = time.perf_counter()
            key, step_key = jax.random.split(key)
            grad, state, metrics = estimator.gradient(theta, step_key, state)
            updates, meta_state = meta_optimizer.update(grad, meta_state, theta)
            theta = optax.apply_updates(theta, updates)
        jax.block_until_ready(theta)
        return steps / (time.perf_counter() - start)

    vectorized = max(run(4, outer_steps, 0), run(4, outer_steps, 2))
    print(f"PES, 4 tasks vmapped: {vectorized:.2f} outer steps/s", flush=True)
    # Baseline: one pair at a time (num_tasks=1), 4 calls per outer step.
    one_pair = run(1, outer_steps * 2, 4) / 4.0
    print(f"PES, 4 tasks one at a time: {one_pair:.2f} outer steps/s", flush=True)
    result = {
        "benchmark": "lopt_outer",
        "setting": "PES, MLPUpdateRule hidden (32, 32), 4 tasks, truncation 50, digits 8x8 MLP 64-32-10 batch 128",
        "pes_outer_steps_per_s": round(vectorized, 2),
        "reference_steps_per_s": REFERENCE_STEPS_PER_S,
        "ratio_to_reference": round(vectorized / REFERENCE_STEPS_PER_S, 3),
        "one_task_at_a_time_steps_per_s": round(one_pair, 2),
        "vectorized_over_loop": round(vectorized / one_pair, 2),
        "device": str(jax.devices()[0].platform),
        "small": args.small,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
