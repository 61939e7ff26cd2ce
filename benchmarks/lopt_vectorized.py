"""Vectorized inner training: 32 tasks in one vmapped, jitted step vs a Python loop of jitted steps.

Both sides run the same work: one inner step (minibatch, loss gradient, learned-optimizer update)
of the 8x8-digits MLP task (64-32-10, batch 128) under the MLP learned optimizer, for each of 32
task instances. The loop calls the jitted single-task step 32 times per round; the vectorized side
calls the jitted ``vmap`` of that same step once per round, and again with the task axis split
over the host devices (``NamedSharding(task_mesh(32), P("tasks"))``; the script sets
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` before JAX starts unless XLA_FLAGS already
names a device count; the loop and the plain vmapped step run on one device as before). Figures
are medians over interleaved repeats (the machine is shared); the 1-minute load average is
printed with them. A second, secondary measurement repeats
this on a 64-dim quadratic, where per-call overhead rather than arithmetic dominates. It also
measures the most this machine allows (``speedup_ceiling_flops_32``, ``speedup_ceiling_roofline_32``:
the loop's time over the vmapped step's FLOPs and bytes, from XLA's cost analysis, at this machine's
best matmul and streaming rates; see ``ceiling``) and the share of it reached,
``vectorized_over_ceiling_32`` (the vectorized speedup over the roofline ceiling). Prints one JSON
object last.

    python benchmarks/lopt_vectorized.py [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import time

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if HOST_DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {HOST_DEVICES_FLAG}=2".strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from carlskit.lopt import DigitsMLPTask, MLPUpdateRule, QuadraticTask, task_mesh  # noqa: E402
from carlskit.lopt._inner import init_inner_state, unroll  # noqa: E402

REPEATS = 5


def measure(rule, task, num_tasks: int, rounds: int, label: str) -> tuple[list, list, list]:
    """Task-steps/s of (Python loop of jitted single steps, one jitted vmapped step, the vmapped step
    split over the local devices): lists over repeats."""
    meta_params = rule.init_meta_params(jax.random.PRNGKey(0))
    task_keys = jax.random.split(jax.random.PRNGKey(1), num_tasks)

    def task_params(task_key):
        return task.sample_task_params(jax.random.fold_in(task_key, 2))

    def init(task_key):
        return init_inner_state(rule, task, task_key, task_params(task_key))

    def step(theta, state, task_key):
        state, losses = unroll(rule, task, theta, state, task_key, task_params(task_key), 1)
        return state, losses[0]

    single_step = jax.jit(step)
    vector_step = jax.jit(jax.vmap(step, in_axes=(None, 0, 0)))
    states = [init(k) for k in task_keys]
    batched = jax.vmap(init)(task_keys)
    mesh = task_mesh(num_tasks)
    if mesh is None:  # one device: the split step is the plain one
        split_step, split_args = vector_step, (meta_params, batched, task_keys)
    else:
        split, replicated = NamedSharding(mesh, PartitionSpec("tasks")), NamedSharding(mesh, PartitionSpec())
        split_step = jax.jit(jax.vmap(step, in_axes=(None, 0, 0)), in_shardings=(replicated, split, split),
                             out_shardings=(split, split))
        split_args = (jax.device_put(meta_params, replicated), jax.device_put(batched, split),
                      jax.device_put(task_keys, split))
    split_theta, split_batched, split_keys = split_args
    # Warm up (compile) all three.
    for i in range(num_tasks):
        states[i], _ = single_step(meta_params, states[i], task_keys[i])
    batched, _ = vector_step(meta_params, batched, task_keys)
    split_batched, _ = split_step(split_theta, split_batched, split_keys)
    jax.block_until_ready((states, batched, split_batched))

    def time_loop() -> float:
        nonlocal states
        start = time.perf_counter()
        for _ in range(rounds):
            for i in range(num_tasks):
                states[i], _ = single_step(meta_params, states[i], task_keys[i])
        jax.block_until_ready(states)
        return num_tasks * rounds / (time.perf_counter() - start)

    def time_batched(batched_step, theta, state, keys):
        """(task-steps/s over ``rounds`` calls of a one-call-for-all-tasks step, its final state)."""
        start = time.perf_counter()
        for _ in range(rounds):
            state, _ = batched_step(theta, state, keys)
        jax.block_until_ready(state)
        return num_tasks * rounds / (time.perf_counter() - start), state

    # Interleave repeats (the machine is shared); the caller reports medians and bests.
    loop_rates, vector_rates, split_rates = [], [], []
    for repeat in range(REPEATS):
        loop_rates.append(time_loop())
        rate, batched = time_batched(vector_step, meta_params, batched, task_keys)
        vector_rates.append(rate)
        rate, split_batched = time_batched(split_step, split_theta, split_batched, split_keys)
        split_rates.append(rate)
        print(f"{label} repeat {repeat}: loop {loop_rates[-1]:.0f} task-steps/s, "
              f"vmapped {vector_rates[-1]:.0f}, vmapped over {1 if mesh is None else mesh.devices.size} devices "
              f"{split_rates[-1]:.0f} (load {os.getloadavg()[0]:.2f})", flush=True)
    return loop_rates, vector_rates, split_rates


def best_seconds(fn, *args, repeats: int = 20, calls: int = 20) -> float:
    """Best over ``repeats`` of the mean time of ``calls`` calls of a jitted ``fn`` (after one warm-up)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def ceiling(rule, task, num_tasks: int, loop_rate: float) -> dict:
    """Upper bounds on the vectorized speedup that this machine allows, measured in this process.

    The vmapped step's work is taken from XLA's own cost analysis (FLOPs and bytes accessed per
    call). It cannot run faster than all its FLOPs at the best rate of the matmul that dominates it
    (the optimizer MLP's hidden layer, ``[h, h] @ [h, num_tasks * num_params]``, best of repeats),
    nor faster than all its bytes at the machine's best streaming rate on tensors of that size.
    ``loop time / that time`` bounds the speedup from above (the loop is timed as measured).
    """
    meta_params = rule.init_meta_params(jax.random.PRNGKey(0))
    task_keys = jax.random.split(jax.random.PRNGKey(1), num_tasks)

    def task_params(task_key):
        return task.sample_task_params(jax.random.fold_in(task_key, 2))

    def step(theta, state, task_key):
        state, losses = unroll(rule, task, theta, state, task_key, task_params(task_key), 1)
        return state, losses[0]

    batched = jax.vmap(lambda k: init_inner_state(rule, task, k, task_params(k)))(task_keys)
    cost = (jax.jit(jax.vmap(step, in_axes=(None, 0, 0))).lower(meta_params, batched, task_keys)
            .compile().cost_analysis())
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops, bytes_accessed = float(cost["flops"]), float(cost["bytes accessed"])
    num_params = sum(x.size for x in jax.tree.leaves(task.init(jax.random.PRNGKey(0), task_params(task_keys[0]))))
    width = rule.hidden_sizes[-1]
    weights = jax.random.normal(jax.random.PRNGKey(2), (width, width), jnp.float32)
    hidden = jax.random.normal(jax.random.PRNGKey(3), (width, num_tasks * num_params), jnp.float32)
    matmul_s = best_seconds(jax.jit(lambda w, h: w.T @ h), weights, hidden)
    matmul_flops_per_s = 2.0 * width * width * hidden.shape[1] / matmul_s
    stream_s = best_seconds(jax.jit(lambda h: h * 2.0), hidden)
    stream_bytes_per_s = 2.0 * hidden.size * hidden.dtype.itemsize / stream_s  # read + write
    loop_call_s = num_tasks / loop_rate  # one round of the loop: the same work as one vmapped call
    flops_s, bytes_s = flops / matmul_flops_per_s, bytes_accessed / stream_bytes_per_s
    return {
        "vmapped_step_gflop": round(flops / 1e9, 4),
        "vmapped_step_mbytes_accessed": round(bytes_accessed / 1e6, 1),
        "matmul_gflop_per_s": round(matmul_flops_per_s / 1e9, 1),
        "stream_gbytes_per_s": round(stream_bytes_per_s / 1e9, 1),
        f"speedup_ceiling_flops_{num_tasks}": round(loop_call_s / flops_s, 2),
        f"speedup_ceiling_roofline_{num_tasks}": round(loop_call_s / max(flops_s, bytes_s), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", default=os.environ.get("CARLSKIT_SMALL") == "1")
    parser.add_argument("--num-tasks", type=int, default=32)
    args = parser.parse_args()
    rounds = 10 if args.small else 40
    num_tasks = args.num_tasks
    rule = MLPUpdateRule()
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}: {len(jax.local_devices())} local devices", flush=True)
    loop_rates, vector_rates, split_rates = measure(rule, DigitsMLPTask((32,), "relu", 128), num_tasks, rounds,
                                                    "digits MLP")
    # Secondary: a tiny task (64-dim quadratic) where per-call overhead, not arithmetic, dominates.
    digits_ceiling = ceiling(rule, DigitsMLPTask((32,), "relu", 128), num_tasks, float(np.median(loop_rates)))
    print(f"digits MLP ceiling: {digits_ceiling}", flush=True)
    small_loop, small_vector, _ = measure(rule, QuadraticTask(64, 10.0, 0.1), num_tasks, rounds * 5, "quadratic")
    loop_rate, vector_rate = float(np.median(loop_rates)), float(np.median(vector_rates))
    result = {
        "benchmark": "lopt_vectorized",
        "num_tasks": num_tasks,
        "task": "digits 8x8 MLP 64-32-10, batch 128",
        "optimizer": "MLPUpdateRule hidden (32, 32)",
        "repeats": REPEATS,
        "loop_inner_steps_per_s": round(loop_rate, 1),
        "vectorized_inner_steps_per_s": round(vector_rate, 1),
        f"vectorized_speedup_{num_tasks}": round(vector_rate / loop_rate, 2),
        f"vectorized_speedup_{num_tasks}_best_of_each": round(max(vector_rates) / max(loop_rates), 2),
        "target_speedup": 8.0,
        "split_devices": 1 if task_mesh(num_tasks) is None else int(task_mesh(num_tasks).devices.size),
        "vectorized_split_inner_steps_per_s": round(float(np.median(split_rates)), 1),
        f"vectorized_split_speedup_{num_tasks}": round(float(np.median(split_rates)) / loop_rate, 2),
        **digits_ceiling,
        # The share of the ceiling reached: vectorized speedup / roofline ceiling (target >= 0.7). Both
        # divide by the same loop time, so this is the roofline bound / the vmapped step's time.
        f"vectorized_over_ceiling_{num_tasks}": round(
            vector_rate / loop_rate / digits_ceiling[f"speedup_ceiling_roofline_{num_tasks}"], 2),
        f"quadratic64_vectorized_speedup_{num_tasks}": round(float(np.median(small_vector) / np.median(small_loop)), 2),
        "quadratic64_loop_inner_steps_per_s": round(float(np.median(small_loop)), 1),
        "quadratic64_vectorized_inner_steps_per_s": round(float(np.median(small_vector)), 1),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "device": str(jax.devices()[0].platform),
        "small": args.small,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
