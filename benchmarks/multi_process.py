"""One model over several processes (``carlskit.cluster.run_spmd``, gloo collectives on CPU): what a
second process buys, and what its collectives cost.

Each variant is a process group launched on the workers of an embedded 2-worker cluster; every rank
is bound to its own core before JAX starts (``run_spmd(cpus_per_process=1)``: JAX sizes its CPU thread
pool from it), so "2 processes" is two cores and "1 process" one:

- ``dp``: ``Trainer.fit`` of a 3-layer MLP (``--width`` wide, inputs as wide; 3 x width^2 weights,
  3 MB of float32 gradients at 512), data parallel, the same per-process batch in both variants
  (``--small-batch`` and ``--large-batch`` rows per process and step). Throughput = global rows /
  step time; ``dp_2proc_over_1proc`` = 2 * t(1 process) / t(2 processes) at the large batch
  (``_small`` at the small one) with ``Trainer(data_parallel="local")`` (each device's loss, one
  flat all-reduce of the gradients); ``dp_2proc_over_1proc_global`` (and ``_global_small``) with
  the default ``"global"`` step (XLA partitions it: one collective per parameter on CPU). 2.0 is
  perfect scaling; 1.0 means the second process bought nothing.
- ``moe``: ``MoEModel.fit`` (8 experts over all devices: the dispatch is an all-to-all across the
  processes), the same per-process batch; ``moe_2proc_over_1proc`` likewise.
- the bytes one step's collectives move (from the compiled program: all-reduce, all-to-all, per
  step and process) and ``allreduce_gbps``: algorithmic bandwidth of one all-reduce of the dp
  model's gradient size between the two processes.

The step time of each variant is the mean of its Trainer records' ``step_seconds`` after
``--skip`` steps (compilation), from the rank-0 process; the variants run interleaved,
``--repeats`` times, and the ratios are medians of per-repeat ratios with their spread
(``benchmarks/_timing.py``).

    python benchmarks/multi_process.py [--steps 30] [--repeats 3] [--width 512]
Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleave, medians, ratio  # noqa: E402

COLLECTIVES = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes of the results of each kind of collective in a compiled program's text (per process),
    the number of ops of each kind (``KIND_ops``) and of the buffers they reduce or move
    (``KIND_buffers``: a combined op over a tuple still runs one collective per buffer on CPU)."""
    totals = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo.splitlines():
        for kind in COLLECTIVES:
            if f" {kind}(" in line or f" {kind}-start(" in line:
                totals[f"{kind}_ops"] = totals.get(f"{kind}_ops", 0) + 1
                shape = line.split("=", 1)[1].split(f" {kind}", 1)[0]
                buffers = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape)
                totals[f"{kind}_buffers"] = totals.get(f"{kind}_buffers", 0) + len(buffers)
                for dtype, dims in buffers:
                    count = 1
                    for d in filter(None, dims.split(",")):
                        count *= int(d)
                    totals[kind] += count * BYTES.get(dtype, 4)
    return totals


def rank_measurements(width: int, batches: tuple[int, ...], steps: int, skip: int, moe_batch: int) -> dict:
    """In each rank (bound to one core): dp step time at each per-process batch, the MoE step time,
    the collectives' bytes per step and one all-reduce's bandwidth. Rank 0's dict is the result."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from carlskit.moe import MoEModel, make_mesh
    from carlskit.training import Trainer

    count = jax.process_count()

    class MLP(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(3)])

        def __call__(self, x):
            for layer in self.layers:
                x = nnx.relu(layer(x))
            return x.mean(axis=1)

    def mse(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}

    result: dict = {"processes": count}
    for per_process in batches:
        rows = per_process * count
        data = np.random.default_rng(0).normal(size=(rows, width)).astype(np.float32)
        batch = {"x": data, "y": data.mean(axis=1)}
        for mode, prefix in (("local", "dp"), ("global", "dp_global")):
            trainer = Trainer(MLP(), optax.sgd(1e-3), mse, check_finite=False, data_parallel=mode)
            history = trainer.fit(lambda step: batch, steps, progress=False, live=False)
            result[f"{prefix}_step_{per_process}"] = float(np.mean([r["step_seconds"] for r in history[skip:]]))
            if per_process == batches[-1]:
                placed = trainer._place(trainer._source(lambda step: batch, 0)())
                hlo = trainer._train_step.lower(trainer._state, placed).compile().as_text()
                result[f"{prefix}_bytes"] = collective_bytes(hlo)

    if count > 1:  # the lever: the same data-parallel step by hand, gradients summed in float32 or bfloat16
        result.update(gradient_precision_steps(width, batches[-1], steps, skip))

    mesh = make_mesh(1, jax.device_count(), devices=jax.devices()) if jax.device_count() > 1 else None
    model = MoEModel(256, 2, 128, 4, 8, max_length=64, mesh=mesh, capacity_factor=2.0, seed=0)
    tokens = np.random.default_rng(1).integers(0, 256, (moe_batch * count * 4, 65)).astype(np.int32)
    history = model.fit(tokens, steps=steps, batch_size=moe_batch * count, seed=0)
    result["moe_step"] = float(np.mean([r["step_seconds"] for r in history[skip:]]))
    graphdef, state = nnx.split(model)
    moe_step = jax.jit(jax.grad(lambda s, t: nnx.merge(graphdef, s).loss(t, rng=jax.random.key(0))))
    result["moe_bytes"] = collective_bytes(
        moe_step.lower(state, model.shard_batch(tokens[: moe_batch * count])).compile().as_text())

    if count > 1:  # one all-reduce of the dp model's gradient size across the processes
        global_mesh = jax.make_mesh((jax.device_count(),), ("d",), devices=jax.devices())
        elements = 3 * width * width
        values = jax.device_put(np.ones((jax.device_count(), elements), np.float32), NamedSharding(global_mesh, P("d")))
        reduce = jax.jit(lambda v: v.sum(axis=0), out_shardings=NamedSharding(global_mesh, P()))
        reduce(values).block_until_ready()
        start, repeats = time.perf_counter(), 20
        for _ in range(repeats):
            reduce(values).block_until_ready()
        seconds = (time.perf_counter() - start) / repeats
        result["allreduce_seconds"] = seconds
        result["allreduce_gbps"] = elements * 4 / seconds / 1e9
    return result


def gradient_precision_steps(width: int, per_process: int, steps: int, skip: int) -> dict:
    """Step time of a hand-written data-parallel step (``jax.shard_map``: local gradients, one
    ``psum`` per layer's weights) with the gradients communicated in float32 and in bfloat16 (half
    the bytes; summed in bfloat16, cast back)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
    rng = np.random.default_rng(0)  # the same weights on every process (NumPy, not one device's draw)
    weights = [jax.device_put((rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32),
                              NamedSharding(mesh, P())) for _ in range(3)]
    rows = per_process * jax.process_count()
    x = np.random.default_rng(0).normal(size=(rows, width)).astype(np.float32)
    local = x[jax.process_index() * per_process:(jax.process_index() + 1) * per_process]
    batch = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)

    def loss(ws, x):
        for w in ws:
            x = jax.nn.relu(x @ w)
        return jnp.mean((x.mean(axis=1) - 1.0) ** 2)

    out: dict = {}
    for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        def step(ws, x, dtype=dtype):
            grads = jax.grad(loss)(ws, x)
            summed = [jax.lax.psum(g.astype(dtype), "data").astype(jnp.float32) / jax.device_count() for g in grads]
            return [w - 1e-3 * g for w, g in zip(ws, summed)]

        sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
        ws, times = weights, []
        for _ in range(steps):
            started = time.perf_counter()
            ws = sharded(ws, batch)
            jax.block_until_ready(ws)
            times.append(time.perf_counter() - started)
        out[f"manual_step_{name}"] = float(np.mean(times[skip:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--small-batch", type=int, default=256)
    parser.add_argument("--large-batch", type=int, default=2048)
    parser.add_argument("--moe-batch", type=int, default=16, help="MoE sequences of 64 tokens per process and step")
    args = parser.parse_args()

    import carlskit
    from carlskit.cluster import run_spmd

    client = carlskit.connect(n_workers=2, threads_per_worker=1)
    batches = (args.small_batch, args.large_batch)
    runs: dict[str, list[dict]] = {"one": [], "two": []}

    def variant(processes: int, name: str):
        def run() -> float:
            started = time.perf_counter()
            runs[name].append(run_spmd(client, rank_measurements, args.width, batches, args.steps, args.skip,
                                       args.moe_batch, processes=processes, devices_per_process=1, cpus_per_process=1,
                                       output=False)[0])
            return time.perf_counter() - started
        return run

    try:
        interleave({"one": variant(1, "one"), "two": variant(2, "two")}, repeats=args.repeats, warmup=False)
    finally:
        client.close()
    results: dict = {"width": args.width, "parameters": 3 * args.width * (args.width + 1),
                     "small_batch": args.small_batch, "large_batch": args.large_batch, "moe_batch": args.moe_batch,
                     "steps": args.steps, "repeats": args.repeats, "load": os.getloadavg()[0]}
    # throughput ratio = (2 rows / t2) / (rows / t1) = 2 * t1 / t2, per repeat
    for key, label in ((f"dp_step_{args.large_batch}", "dp_2proc_over_1proc"),
                       (f"dp_step_{args.small_batch}", "dp_2proc_over_1proc_small"),
                       (f"dp_global_step_{args.large_batch}", "dp_2proc_over_1proc_global"),
                       (f"dp_global_step_{args.small_batch}", "dp_2proc_over_1proc_global_small"),
                       ("moe_step", "moe_2proc_over_1proc")):
        samples = {"one": [2 * r[key] for r in runs["one"]], "two": [r[key] for r in runs["two"]]}
        results.update(ratio(samples, "one", "two", label))
        results[f"{label}_ms"] = {"1proc_x2": 1e3 * medians(samples)["one"], "2proc": 1e3 * medians(samples)["two"]}
    results["dp_collective_bytes_per_step"] = runs["two"][-1]["dp_bytes"]
    results["dp_global_collective_bytes_per_step"] = runs["two"][-1]["dp_global_bytes"]
    results["moe_collective_bytes_per_step"] = runs["two"][-1]["moe_bytes"]
    for name in ("f32", "bf16"):
        results[f"manual_dp_step_{name}_ms"] = 1e3 * statistics.median(r[f"manual_step_{name}"] for r in runs["two"])
    results["bf16_gradients_step_over_f32"] = results["manual_dp_step_bf16_ms"] / results["manual_dp_step_f32_ms"]
    results["allreduce_gbps"] = float(sorted(r["allreduce_gbps"] for r in runs["two"])[len(runs["two"]) // 2])
    results["allreduce_ms"] = 1e3 * float(sorted(r["allreduce_seconds"] for r in runs["two"])[len(runs["two"]) // 2])
    print(json.dumps(results))


if __name__ == "__main__":
    main()
