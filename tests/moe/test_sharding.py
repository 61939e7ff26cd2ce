"""Sharding annotations, and MoEModel on 8 simulated CPU devices (in a subprocess), in float32
and in bfloat16 training."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from carlskit.moe import replicate, split

REPO = pathlib.Path(__file__).resolve().parents[2]

MESH_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from carlskit.moe import MoEModel, make_mesh, shard, split, replicate

    assert len(jax.devices()) == 8
    tokens = np.random.default_rng(0).integers(0, 32, (8, 9)).astype(np.int32)

    def loss_and_grads(mesh):
        model = MoEModel(32, 2, 16, 2, 8, max_length=8, mesh=mesh, capacity_factor=1.0, seed=1)
        graphdef, state = nnx.split(model)
        loss = lambda s, t: nnx.merge(graphdef, s).loss(t, rng=jax.random.key(7))  # policy "random"
        step = jax.jit(jax.value_and_grad(loss))
        batch = model.shard_batch(tokens)
        value, grads = step(state, batch)
        params = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state)}
        hlo = step.lower(state, batch).compile().as_text() if mesh is not None else ""
        wi = state["blocks"][1]["ffn"]["expert_wi"][...]
        return float(value), grads, params, hlo, str(wi.sharding.spec) if mesh is not None else ""

    reference_loss, reference_grads, reference_params, _, _ = loss_and_grads(None)
    result = {}
    for shape in [(1, 8), (2, 4), (4, 2)]:
        value, grads, params, hlo, wi_spec = loss_and_grads(make_mesh(*shape))
        grad_error = max(jax.tree.leaves(jax.tree.map(
            lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))), reference_grads, grads)))
        result[str(shape)] = dict(
            loss_error=abs(value - reference_loss), grad_error=grad_error,
            grad_scale=max(float(np.max(np.abs(np.asarray(g)))) for g in jax.tree.leaves(reference_grads)),
            same_params=all(np.array_equal(reference_params[k], params[k]) for k in reference_params),
            all_to_all=hlo.count(" all-to-all("), all_gather=hlo.count(" all-gather("), wi_spec=wi_spec,
        )

    mesh = make_mesh(2, 4)
    x = jnp.arange(64.0).reshape(8, 8)
    annotations = [lambda x: split(x, 0, ("data", "expert"), mesh=mesh), lambda x: replicate(x, mesh=mesh),
                   lambda x: shard(x, np.arange(8).reshape(4, 2))]
    result["annotations"] = [jax.jit(f)(x).sharding.shard_shape(x.shape) for f in annotations]

    print(json.dumps(result))
    """
)


BFLOAT16_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from carlskit.moe import MoEModel, make_mesh

    assert len(jax.devices()) == 8
    # bfloat16 training (float32 master weights) on a (2, 4) mesh, rows with padding, against
    # float32 training on one device: same batches, same routing draws.
    text = np.random.default_rng(2).integers(0, 31, (16, 9)).astype(np.int32)
    text[::2, 5:] = 31

    def train(mesh, dtype):
        model = MoEModel(32, 2, 16, 2, 8, max_length=8, mesh=mesh, dtype=dtype, pad_id=31, seed=1)
        history = model.fit(text, steps=8, batch_size=8, learning_rate=1e-2, seed=0)
        kinds = sorted({str(leaf.dtype) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))})
        return [float(v) for v in history.column("cross_entropy")], kinds

    result = {}
    result["float32"], _ = train(None, jnp.float32)
    result["bfloat16_mesh"], result["bfloat16_param_dtypes"] = train(make_mesh(2, 4), jnp.bfloat16)
    print(json.dumps(result))
    """
)


def run_on_8_devices(script: str, timeout: int) -> dict:
    """Run ``script`` in a subprocess with 8 simulated CPU devices; its last stdout line as JSON."""
    env = dict(os.environ)
    # 8 simulated devices; -O0 for XLA's CPU backend keeps the compilations quick (numerics unchanged).
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    completed = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_annotations_are_identity_without_mesh():
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(np.asarray(split(x, 1, "expert")), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(replicate(x)), np.asarray(x))
    with pytest.raises(ValueError, match="dim"):
        split(x, 2, "data")


@pytest.mark.slow
def test_meshes_match_one_device_and_dispatch_is_all_to_all():
    result = run_on_8_devices(MESH_SCRIPT, timeout=280)
    for shape in ("(1, 8)", "(2, 4)", "(4, 2)"):
        mesh_result = result[shape]
        assert mesh_result["same_params"], shape
        assert mesh_result["loss_error"] < 1e-5, (shape, mesh_result)
        assert mesh_result["grad_error"] < 1e-5 * max(1.0, mesh_result["grad_scale"]), (shape, mesh_result)
        assert mesh_result["all_to_all"] >= 2, (shape, mesh_result)  # dispatch and combine (forward)
        assert mesh_result["all_gather"] == 0, (shape, mesh_result)  # activations are never gathered
        assert "'expert'" in mesh_result["wi_spec"], mesh_result  # expert weights split over "expert"
    assert result["annotations"] == [[1, 8], [8, 8], [2, 4]]


@pytest.mark.slow
def test_bfloat16_training_on_8_devices_tracks_float32_on_one():
    result = run_on_8_devices(BFLOAT16_SCRIPT, timeout=280)
    # bfloat16 on 8 devices tracks float32 on one: every step's loss within 5% (stated tolerance),
    # master weights stay float32.
    float32, bfloat16 = np.asarray(result["float32"]), np.asarray(result["bfloat16_mesh"])
    assert np.max(np.abs(bfloat16 - float32) / float32) < 0.05, (float32, bfloat16)
    assert result["bfloat16_param_dtypes"] == ["float32"]
