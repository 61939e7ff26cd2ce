"""Checkpoints under damage: every flipped byte is detected, never loaded; readers take the newest intact one."""

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_models import Linear

import carlskit
from carlskit.training import CheckpointStore, Trainer


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def data(step):
    x = np.random.default_rng(step).normal(size=(16, 4)).astype(np.float32)
    return {"x": x, "y": x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)}


def flip(path, position, mask=0x01):
    raw = bytearray(path.read_bytes())
    raw[position] ^= mask
    path.write_bytes(bytes(raw))


def trained_store(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    trainer = Trainer(Linear(), optax.adam(0.1), mse, checkpoints=store, checkpoint_every=10)
    trainer.fit(data, 20, progress=False)
    assert store.versions() == [10, 20]
    return store, trainer


def test_a_flipped_step_in_the_trainers_manifest_is_detected_and_resume_takes_the_newest_intact(tmp_path):
    store, trainer = trained_store(tmp_path)
    manifest = tmp_path / "ckpt" / "v000000000020.json"
    text = manifest.read_text()
    assert '"step": 20' in text
    manifest.write_text(text.replace('"step": 20', '"step": 30'))  # one byte: 2 -> 3
    with pytest.raises(carlskit.CorruptFileError, match=r"v000000000020\.json: corrupt file .*SHA-256") as caught:
        store.load(20)
    assert caught.value.path.endswith("v000000000020.json")

    resumed = Trainer(Linear(seed=5), optax.adam(0.1), mse, checkpoints=CheckpointStore(tmp_path / "ckpt", keep=None),
                      checkpoint_every=10)
    assert resumed.step == 10, "resumed from the newest intact checkpoint, not the damaged step 30 (or 20)"
    assert list(resumed.checkpoints.corrupt_versions()) == [20]
    expected, _ = store.load(10)
    kernel = next(value for name, value in expected.items() if name.startswith("['model']") and "kernel" in name)
    np.testing.assert_array_equal(np.asarray(resumed.model.linear.kernel[...]), kernel)
    resumed.fit(data, 10, progress=False)  # step 20 again: the damaged version is overwritten by an intact one
    assert resumed.checkpoints.latest() == 20 and resumed.checkpoints.corrupt_versions() == {}
    assert CheckpointStore(tmp_path / "ckpt").load(20)[1]["step"] == 20


def test_a_flipped_byte_in_the_arrays_is_detected_and_latest_falls_back(tmp_path):
    store, _ = trained_store(tmp_path)
    npz = tmp_path / "ckpt" / "v000000000020.npz"
    flip(npz, npz.stat().st_size // 2)
    fresh = CheckpointStore(tmp_path / "ckpt", keep=None)
    assert fresh.latest() == 10
    assert "v000000000020.npz" in fresh.corrupt_versions()[20]
    with pytest.raises(carlskit.CorruptFileError, match=r"v000000000020\.npz: corrupt file \(SHA-256 differs"):
        fresh.load(20)
    version, tree, metadata = fresh.load_latest()
    assert version == 10 and metadata["step"] == 10


@pytest.mark.parametrize("suffix", ["json", "npz"])
def test_every_single_byte_flip_is_a_corrupt_file_error_never_a_load(tmp_path, suffix):
    store = CheckpointStore(tmp_path / "ckpt", keep=None)
    store.save({"w": np.arange(12.0, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.int32)}, version=7,
               metadata={"step": 7, "lr": 0.1})
    path = tmp_path / "ckpt" / f"v000000000007.{suffix}"
    original = path.read_bytes()
    positions = range(len(original)) if suffix == "json" else range(0, len(original), 7)
    for position in positions:
        flip(path, position)
        with pytest.raises(carlskit.CorruptFileError, match=f"v000000000007.{suffix}"):
            CheckpointStore(tmp_path / "ckpt", keep=None).load(7)
        path.write_bytes(original)
    for cut in (0, 1, len(original) // 2, len(original) - 1):  # truncations
        path.write_bytes(original[:cut])
        with pytest.raises(carlskit.CorruptFileError):
            store.load(7)
    path.write_bytes(original)
    assert store.load(7)[1]["lr"] == 0.1


def test_a_manifest_without_a_checksum_is_refused_as_legacy(tmp_path):
    store = CheckpointStore(tmp_path, keep=None)
    store.save({"w": np.ones(2, np.float32)}, version=1)
    manifest = tmp_path / "v000000000001.json"
    content = json.loads(manifest.read_text())["content"]
    legacy = {key: content[key] for key in ("version", "wall_time", "leaves", "key_impls", "metadata")}
    manifest.write_text(json.dumps({**legacy, "format": "carlskit-checkpoint/1"}))  # as written before checksums
    with pytest.raises(carlskit.CorruptFileError, match="carlskit-checkpoint/1 manifest without a checksum"):
        store.load(1)
    assert store.latest() is None
    with pytest.raises(FileNotFoundError, match=r"no intact checkpoint .*damaged: \{1:"):
        store.load()
