import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from carlskit._errors import CorruptFileError
from carlskit.training import CheckpointStore, restore_model


class Net(nnx.Module):
    def __init__(self, seed):
        rngs = nnx.Rngs(params=seed, dropout=seed + 1)
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


def _leaves(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("path", ["local", "memory://carlskit-test-ckpt"])
def test_nnx_model_and_optax_state_round_trip_exactly(tmp_path, path):
    model = Net(0)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((4, 3))) ** 2))(model)
    optimizer.update(model, grads)
    store = CheckpointStore(str(tmp_path / "ckpt") if path == "local" else path, keep=2)
    for version in (3, 7, 9):
        store.save({"model": nnx.state(model), "optimizer": nnx.state(optimizer)}, version=version,
                   metadata={"step": version})
    assert store.versions() == [7, 9] and store.latest() == 9
    fresh = Net(5)
    fresh_optimizer = nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param)
    tree, metadata = store.load(target={"model": nnx.state(fresh), "optimizer": nnx.state(fresh_optimizer)})
    nnx.update(fresh, tree["model"])
    nnx.update(fresh_optimizer, tree["optimizer"])
    assert metadata["step"] == 9
    for a, b in zip(_leaves((nnx.state(model), nnx.state(optimizer))),
                    _leaves((nnx.state(fresh), nnx.state(fresh_optimizer)))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    other = Net(7)
    flat, metadata = store.load(7)
    restore_model(other, flat, metadata)
    np.testing.assert_array_equal(other.linear.kernel[...], model.linear.kernel[...])


def test_store_rejects_old_versions_and_mismatched_targets(tmp_path):
    store = CheckpointStore(tmp_path, keep=None)
    store.save({"w": np.zeros(3, np.float32)}, version=1)
    with pytest.raises(ValueError, match="not newer"):
        store.save({"w": np.zeros(3, np.float32)}, version=1)
    with pytest.raises(ValueError, match="shape"):
        store.load(1, target={"w": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="missing"):
        store.load(1, target={"v": np.zeros(3, np.float32)})
    with pytest.raises(FileNotFoundError, match="version 2"):
        store.load(2)
    assert store.versions() == [1]


def test_a_checkpoint_without_its_manifest_does_not_exist(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save({"w": np.ones(2)}, version=1)
    (tmp_path / f"v{2:012d}.npz").write_bytes(b"half-written")  # a writer died before its manifest
    assert store.versions() == [1]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_bfloat16_leaves_round_trip(tmp_path):
    store = CheckpointStore(tmp_path)
    tree = {"w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3) / 3}
    store.save(tree, version=1)
    loaded, _ = store.load(1, target=tree)
    assert loaded["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded["w"]), np.asarray(tree["w"]))
    flat, _ = store.load(1)
    assert flat["['w']"].dtype == jnp.bfloat16


@pytest.mark.parametrize("damage", ["truncated npz", "empty npz", "manifest not json", "manifest a list",
                                    "manifest without leaves", "array missing"])
def test_a_corrupt_checkpoint_is_an_error_naming_its_file(tmp_path, damage):
    store = CheckpointStore(tmp_path / "ckpt")
    store.save({"w": np.arange(6.0), "b": np.ones(2)}, version=1)
    npz, manifest = tmp_path / "ckpt" / "v000000000001.npz", tmp_path / "ckpt" / "v000000000001.json"
    assert npz.exists() and manifest.exists()
    if damage == "truncated npz":
        npz.write_bytes(npz.read_bytes()[:100])
    elif damage == "empty npz":
        npz.write_bytes(b"")
    elif damage == "manifest not json":
        manifest.write_text("{not json")
    elif damage == "manifest a list":
        manifest.write_text("[1, 2]")
    elif damage == "manifest without leaves":
        manifest.write_text('{"metadata": {}}')
    else:
        with np.load(npz) as content:
            kept = {name: content[name] for name in content.files[:1]}
        np.savez(npz, **kept)  # one array is gone, the manifest still lists it
    with pytest.raises(CorruptFileError, match=r"v000000000001\.(npz|json): corrupt file"):
        store.load(1)
    assert store.latest() is None and 1 in store.corrupt_versions()
