"""Accelerator-ready training: with ``CARLSKIT_TRANSFER_GUARD=disallow`` a Trainer's steady-state
steps move nothing between host and device but the batch in and the record's numbers out (issue 40).

The guard fires on CPU as on a GPU, so an implicit transfer that would stall an accelerator fails here.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_models import Linear, mse, sum_batch

from carlskit.training import Trainer

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def guarded(monkeypatch):
    """The loops' steady-state steps run under ``jax.transfer_guard("disallow")``."""
    monkeypatch.setenv("CARLSKIT_TRANSFER_GUARD", "disallow")


def test_a_fit_on_numpy_batches_transfers_only_the_batch_and_the_record(guarded):
    trainer = Trainer(Linear(), optax.sgd(0.1), mse)
    history = trainer.fit(sum_batch, 6, progress=False, live=False)
    assert [record["step"] for record in history] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(record["loss"]) for record in history)


def test_a_second_fit_is_guarded_from_its_second_step(guarded):
    trainer = Trainer(Linear(), optax.sgd(0.1), mse, checkpoint_every=2)
    trainer.fit(sum_batch, 3, progress=False, live=False)
    assert len(trainer.fit(sum_batch, 3, progress=False, live=False)) == 6


def test_the_guard_catches_an_implicit_transfer_in_the_input_pipeline(guarded):
    def device_batch(step):  # jnp.asarray of host data: an implicit transfer in every batch
        return {key: jnp.asarray(value) for key, value in sum_batch(step).items()}

    trainer = Trainer(Linear(), optax.sgd(0.1), mse)
    with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
        trainer.fit(device_batch, 4, progress=False, live=False)


def test_without_the_variable_nothing_is_guarded():
    def device_batch(step):
        return {key: jnp.asarray(value) for key, value in sum_batch(step).items()}

    assert len(Trainer(Linear(), optax.sgd(0.1), mse).fit(device_batch, 4, progress=False, live=False)) == 4


MESH_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import optax
    from tiny_models import Linear, mse, sum_batch
    from carlskit.training import Trainer
    trainer = Trainer(Linear(), optax.sgd(0.1), mse)
    assert trainer._mesh is not None and trainer._mesh.devices.size == 4
    print(len(trainer.fit(sum_batch, 4, progress=False, live=False)))
    """
)


@pytest.mark.slow
def test_a_fit_over_four_devices_splits_the_batch_explicitly():
    env = {**os.environ, "CARLSKIT_TRANSFER_GUARD": "disallow", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    completed = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True, text=True,
                               timeout=200, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().splitlines()[-1] == "4"
