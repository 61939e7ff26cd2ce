"""Cost of one learned-optimizer step against Adam's, per parameter (``lopt_step_over_adam_step``).

One jitted ``update`` + ``apply_updates`` of each optimizer on the same parameters and gradients
(an MLP's tensors: 784-1024-1024-10 plus biases, 1.86M parameters; ``--small``: 64-256-256-10,
86k): optax's Adam, the shipped optimizer (``LearnedOptimizer.pretrained()``, a
``HierarchicalRule``) and the per-parameter ``MLPUpdateRule`` (hidden 32x32, the previous shipped
architecture) for reference. Medians over interleaved repeats, each a timed loop of steps with
the state carried (buffers donated, as in a training loop). The issue's bound is about 3x.
Prints one JSON object last.

    python benchmarks/lopt_step.py [--small]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from carlskit.lopt import LearnedOptimizer, MLPUpdateRule


def mlp_params(sizes: tuple[int, ...]) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes) - 1)
    return {f"layer{i}": {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
            for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def stepper(tx: optax.GradientTransformation):
    @functools.partial(jax.jit, static_argnums=3)
    def steps(params, state, grads, count):
        def body(carry, _):
            params, state = carry
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, state), _ = jax.lax.scan(body, (params, state), None, length=count)
        return params, state

    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = (64, 256, 256, 10) if args.small else (784, 1024, 1024, 10)
    params = mlp_params(sizes)
    grads = jax.tree.map(lambda p: 0.01 * jnp.cos(p + 1.0), params)
    num_params = sum(int(p.size) for p in jax.tree.leaves(params))
    shipped = LearnedOptimizer.pretrained()
    mlp_rule = MLPUpdateRule()
    optimizers = {"adam": optax.adam(1e-3), "shipped": shipped.as_optax(),
                  "mlp_rule": LearnedOptimizer(mlp_rule, mlp_rule.init_meta_params(jax.random.PRNGKey(0))).as_optax()}
    count = 20
    runs, seconds = {}, {name: [] for name in optimizers}
    for name, tx in optimizers.items():
        runs[name] = (stepper(tx), tx.init(params))
        jax.block_until_ready(runs[name][0](params, runs[name][1], grads, count))  # compile
    for _ in range(args.repeats):
        for name, (run, state) in runs.items():
            started = time.perf_counter()
            jax.block_until_ready(run(params, state, grads, count))
            seconds[name].append((time.perf_counter() - started) / count)
    median = {name: float(np.median(values)) for name, values in seconds.items()}
    result = {
        "benchmark": "lopt_step", "num_params": num_params, "tensors": len(jax.tree.leaves(params)),
        "rule": type(shipped.rule).__name__,
        "adam_ns_per_param": round(median["adam"] / num_params * 1e9, 3),
        "shipped_ns_per_param": round(median["shipped"] / num_params * 1e9, 3),
        "mlp_rule_ns_per_param": round(median["mlp_rule"] / num_params * 1e9, 3),
        "lopt_step_over_adam_step": round(median["shipped"] / median["adam"], 3),
        "mlp_rule_step_over_adam_step": round(median["mlp_rule"] / median["adam"], 3),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
