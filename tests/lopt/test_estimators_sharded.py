"""PES and full-unroll ES with their pairs split over 2 host devices give the one-device results
(run in a subprocess, because the device count is fixed when JAX starts)."""

import json
import os
import subprocess
import sys

import numpy as np

SHARDED_VS_ONE_DEVICE = r"""
import json, jax, numpy as np, pytest
from carlskit.lopt import LearnableAdamRule, QuadraticTask, make_full_es_estimator, make_pes_estimator, task_mesh

rule, task = LearnableAdamRule(initial_learning_rate=0.05), QuadraticTask(dim=8, condition=10.0, noise_std=0.1)
theta = rule.init_meta_params(jax.random.PRNGKey(0))
config = dict(num_tasks=4, horizon=20, truncation_length=10)  # episodes of 2 calls: restarts happen
one = make_pes_estimator(rule, task, devices=jax.local_devices()[:1], **config)
two = make_pes_estimator(rule, task, **config)  # default: all local devices dividing num_tasks
state_one = one.init(theta, jax.random.PRNGKey(1))
state_two = two.init(theta, jax.random.PRNGKey(1))
grads, losses, max_diff = [], [], 0.0
for i in range(4):
    key = jax.random.PRNGKey(10 + i)
    g1, state_one, m1 = one.gradient(theta, key, state_one)
    g2, state_two, m2 = two.gradient(theta, key, state_two)
    grads.append([np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).tolist() for g in (g1, g2)])
    losses.append([np.asarray(m["pair_losses"]).tolist() for m in (m1, m2)])
    max_diff = max(max_diff, *(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                                for a, b in zip(jax.tree.leaves(state_one), jax.tree.leaves(state_two))))
es_one = make_full_es_estimator(rule, task, num_tasks=4, num_steps=10, devices=jax.local_devices()[:1])
es_two = make_full_es_estimator(rule, task, num_tasks=4, num_steps=10)
es = [es_one(theta, jax.random.PRNGKey(7)), es_two(theta, jax.random.PRNGKey(7))]
es_grads = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]).tolist() for g, _ in es]
es_losses = [np.asarray(m["pair_losses"]).tolist() for _, m in es]
es_devices = sorted({len(leaf.sharding.device_set) for leaf in jax.tree.leaves(es[1])})
shards = {str(i): [list(s.data.shape) for s in leaf.addressable_shards]
          for i, leaf in enumerate(jax.tree.leaves(state_two))}
errors = []
for bad in (lambda: task_mesh(3, jax.local_devices()), lambda: task_mesh(4, [])):
    try:
        bad()
    except (ValueError, TypeError) as e:
        errors.append(type(e).__name__ + ": " + str(e))
print(json.dumps({"devices": len(jax.devices()), "grads": grads, "losses": losses, "state_max_diff": max_diff,
                  "state_devices": sorted({len(l.sharding.device_set) for l in jax.tree.leaves(state_two)}),
                  "one_devices": sorted({len(l.sharding.device_set) for l in jax.tree.leaves(state_one)}),
                  "steps": np.asarray(state_two.inner.step).tolist(), "shards": shards,
                  "odd_default": task_mesh(3) is None, "errors": errors,
                  "es_grads": es_grads, "es_losses": es_losses, "es_devices": es_devices}))
"""


def test_pes_and_es_split_over_two_devices_match_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", SHARDED_VS_ONE_DEVICE], env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    # Every state leaf is split over both devices, half of the 4 tasks on each.
    assert result["state_devices"] == [2] and result["one_devices"] == [1]
    for shapes in result["shards"].values():
        assert len(shapes) == 2 and all(shape[0] == 2 for shape in shapes)
    for one, two in result["grads"]:
        # The pair's loss difference is divided by 2 std = 0.02, so float32 rounding of the losses
        # (the two programs fuse differently) shows up as ~1e-4 of the gradient's scale.
        assert np.linalg.norm(one) > 0
        np.testing.assert_allclose(two, one, rtol=1e-3, atol=1e-3 * np.max(np.abs(one)))
    for one, two in result["losses"]:
        np.testing.assert_allclose(two, one, rtol=1e-5)
    assert result["state_max_diff"] < 1e-4
    # Restarts happened along the 4 calls (horizon 20 = 2 truncations), in step on both estimators.
    assert min(min(pair) for pair in result["steps"]) == 10
    # 3 tasks cannot be split over 2 devices: the default falls back to one, explicit devices are refused.
    assert result["odd_default"]
    assert any("num_tasks (3)" in e for e in result["errors"]) and any("devices" in e for e in result["errors"])
    # Full-unroll ES: same pair losses and gradient; results replicated on both devices.
    assert result["es_devices"] == [2]
    np.testing.assert_allclose(result["es_losses"][1], result["es_losses"][0], rtol=1e-5)
    one, two = result["es_grads"]
    assert np.linalg.norm(one) > 0
    np.testing.assert_allclose(two, one, rtol=1e-3, atol=1e-3 * np.max(np.abs(one)))
