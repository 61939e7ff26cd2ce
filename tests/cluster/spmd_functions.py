"""Functions the process-group tests run in every rank (imported by reference in the ranks)."""

from __future__ import annotations

import os
import time


def global_sum(offset: float) -> tuple[int, int, float]:
    """Each rank: its index, the global device count, and a sum over an array split across all ranks."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from carlskit.cluster import report_progress

    mesh = jax.make_mesh((jax.device_count(),), ("d",), devices=jax.devices())
    values = jax.device_put(np.arange(16.0), NamedSharding(mesh, P("d")))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(values)
    for step in (1, 2):
        report_progress({"step": step, "rank": jax.process_index()})
    print(f"sum {float(total)}")
    print(f"MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_')}")  # Dask's value is dropped
    print(f"cpus {sorted(os.sched_getaffinity(0))}")  # the main thread's binding (cpus_per_process)
    return jax.process_index(), jax.device_count(), float(total) + offset


def _all_reduce() -> float:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("d",), devices=jax.devices())
    values = jax.device_put(np.ones(jax.device_count()), NamedSharding(mesh, P("d")))
    return float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(values))


def rank_one_raises() -> float:
    """Rank 1 raises before the first collective; rank 0 waits in it."""
    import jax

    if jax.process_index() == 1:
        raise ValueError("rank 1's data is bad")
    return _all_reduce()


def rank_one_hangs() -> float:
    """Rank 1 never reaches the collective (alive, heartbeating); rank 0 waits in it."""
    import jax

    if jax.process_index() == 1:
        time.sleep(3600)
    return _all_reduce()


def rank_one_exits() -> float:
    """Rank 1's process dies without a word (as a segfault or an OOM kill would end it)."""
    import jax

    if jax.process_index() == 1:
        os._exit(9)
    return _all_reduce()


def resumable_steps(folder: str, steps: int, seconds_per_step: float) -> int:
    """Count steps with an all-reduce each, rank 0 saving the count to ``folder`` after every step
    (atomically); a relaunched group resumes from it. Returns the steps this launch ran."""
    import jax

    path = os.path.join(folder, "step")
    start = int(open(path).read()) if os.path.exists(path) else 0
    if jax.process_index() == 0:
        with open(os.path.join(folder, "launches"), "a") as file:
            file.write(f"{start}\n")
    from carlskit.cluster import report_progress

    for step in range(start + 1, steps + 1):
        _all_reduce()
        time.sleep(seconds_per_step)
        if jax.process_index() == 0:
            with open(path + ".tmp", "w") as file:
                file.write(str(step))
            os.replace(path + ".tmp", path)
            report_progress({"step": step})
    return steps - start


def moe_forward_and_training() -> dict:
    """An 8-expert MoEModel over every device of the program (experts split over all of them, so the
    dispatch's all-to-all crosses processes in a group): loss, routing and gradients on fixed tokens,
    then three training steps. The same on 1 device (no mesh), 1 x 8 and 2 x 4 processes x devices."""
    import jax
    import numpy as np
    from flax import nnx

    from carlskit.moe import MoEModel, make_mesh

    mesh = make_mesh(1, jax.device_count(), devices=jax.devices()) if jax.device_count() > 1 else None
    tokens = np.random.default_rng(0).integers(0, 32, (16, 9)).astype(np.int32)
    model = MoEModel(32, 2, 16, 2, 8, max_length=8, mesh=mesh, capacity_factor=1.0, seed=1)
    graphdef, state = nnx.split(model)

    def loss(state, tokens):
        return nnx.merge(graphdef, state).loss_and_metrics(tokens, rng=jax.random.key(7))

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    batch = model.shard_batch(tokens)
    (value, metrics), grads = step(state, batch)
    hlo = step.lower(state, batch).compile().as_text()
    grad_norm = float(jax.device_get(sum(jax.numpy.sum(g ** 2) for g in jax.tree.leaves(grads))))
    history = model.fit(tokens, steps=3, batch_size=8, learning_rate=1e-2, seed=0)
    return {"loss": float(jax.device_get(value)), "expert_load": np.asarray(jax.device_get(metrics["expert_load"])),
            "dropped": float(jax.device_get(metrics["dropped_tokens"])), "grad_norm": grad_norm,
            "training": [float(v) for v in history.column("cross_entropy")],
            "all_to_all": hlo.count(" all-to-all("), "processes": jax.process_count(), "devices": jax.device_count()}


def progress_then_rank_one_hangs() -> float:
    """Both ranks finish a step (rank 0 reports it), then rank 1 stops before the next collective."""
    import jax

    from carlskit.cluster import report_progress

    _all_reduce()
    report_progress({"step": 1})
    if jax.process_index() == 1:
        time.sleep(3600)
    return _all_reduce()
