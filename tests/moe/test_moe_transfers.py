"""Accelerator-ready MoE loops: with ``CARLSKIT_TRANSFER_GUARD=disallow``, ``MoEModel.fit``'s and
``TranslationModel.fit``'s steady-state steps and ``TranslationModel`` decoding (greedy and beam,
cached and not) move nothing between host and device but the batch in and the numbers out (issue 40).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from carlskit.moe import MoEModel, TranslationModel

VOCAB, LENGTH = 16, 8
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def guarded(monkeypatch):
    """The loops' steady-state steps run under ``jax.transfer_guard("disallow")``."""
    monkeypatch.setenv("CARLSKIT_TRANSFER_GUARD", "disallow")


def test_moe_fit_transfers_only_the_batch_and_the_record(guarded):
    data = np.random.default_rng(0).integers(0, VOCAB, (16, LENGTH + 1)).astype(np.int32)
    model = MoEModel(VOCAB, 2, 16, 2, 4, max_length=LENGTH, second_expert_policy="random", seed=1)
    history = model.fit(data, steps=6, batch_size=4, eval_tokens=data, eval_every=3)  # two guarded runs
    assert [record["step"] for record in history] == [1, 2, 3, 4, 5, 6]
    assert np.all(np.isfinite(history.column("loss"))) and history.column("expert_load").shape == (6, 1, 4)
    assert len(history.column("eval_loss")) == 2


def tiny_translator():
    return TranslationModel(["fr"], 1, 16, 2, 4, ffn_dim=16, max_source_length=8, max_target_length=8,
                            dropout_rate=0.1, seed=0)


def test_translation_fit_transfers_only_the_batch_and_the_record(guarded):
    model = tiny_translator()
    source = model.encode_sources(["bonjour", "merci", "oui", "non"], "fr")
    target = model.encode_targets(["hello", "thanks", "yes", "no"])
    history = model.fit(source, target, steps=4, batch_size=2, optimizer="adam")
    assert len(history) == 4 and np.all(np.isfinite(history.column("loss")))


@pytest.mark.parametrize(("beam_size", "cached"), [(1, True), (3, True), (3, False)])
def test_decoding_transfers_only_the_source_in_and_the_ids_out(guarded, beam_size, cached):
    model = tiny_translator()
    source = model.encode_sources(["bonjour", "merci", "oui", "non", "chat"], "fr")
    ids = model.generate(source, beam_size=beam_size, cached=cached, batch_size=2)  # batches 2 and 3 guarded
    assert ids.shape == (5, 8)


MESH_SCRIPT = textwrap.dedent(
    """
    import json
    import numpy as np
    from carlskit.moe import MoEModel, make_mesh
    data = np.random.default_rng(0).integers(0, 16, (16, 9)).astype(np.int32)
    model = MoEModel(16, 2, 16, 2, 4, max_length=8, second_expert_policy="random", seed=1, mesh=make_mesh(2, 2))
    print(json.dumps([float(loss) for loss in model.fit(data, steps=4, batch_size=4).column("loss")]))
    """
)


@pytest.mark.slow
def test_moe_fit_on_a_mesh_copies_nothing_between_its_devices():
    # 4 simulated devices: an implicit device-to-device copy (e.g. of the routing key) fails too
    env = {**os.environ, "CARLSKIT_TRANSFER_GUARD": "disallow", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    completed = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True, text=True,
                               timeout=280, cwd=REPO)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert np.all(np.isfinite(json.loads(completed.stdout.strip().splitlines()[-1])))
