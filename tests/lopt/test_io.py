import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from carlskit._errors import CorruptFileError
from carlskit._serialization import arrays_to_npz_bytes, check_seal, dumps_checked_json, loads_checked_json, seal_zip
from carlskit.lopt import LearnableAdam, LearnedOptimizer, MLPUpdateRule
from carlskit.lopt._io import _leaf_record, meta_params_from_bytes


def _small_optimizer(train_horizon=50, seed=3):
    rule = MLPUpdateRule(hidden_sizes=(8, 4), decays=(0.5, 0.9))
    return LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(seed)), train_horizon=train_horizon)


def _entries(file):
    with np.load(file, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def test_save_load_roundtrip_one_file_without_pickle(tmp_path):
    optimizer = _small_optimizer()
    written = optimizer.save(None, tmp_path / "opt")
    assert written == tmp_path / "opt.npz"
    assert sorted(os.listdir(tmp_path)) == ["opt.npz"]  # one file, no temp files left behind
    entries = _entries(written)
    description = loads_checked_json(entries.pop("__carlskit__").tobytes())
    assert len(entries) == len(jax.tree.leaves(optimizer.meta_params)) == len(description["leaves"])
    assert description["config"]["rule"]["kind"] == "mlp" and description["format_version"] == 4
    for spelling in (tmp_path / "opt", tmp_path / "opt.npz", str(written)):
        loaded = LearnedOptimizer.load(spelling)
        assert loaded.rule == optimizer.rule and loaded.train_horizon == 50
        assert jax.tree.structure(loaded.meta_params) == jax.tree.structure(optimizer.meta_params)
        for a, b in zip(jax.tree.leaves(loaded.meta_params), jax.tree.leaves(optimizer.meta_params)):
            np.testing.assert_array_equal(a, b)
    adam = LearnableAdam(initial_learning_rate=3e-3)
    assert adam.save(None, tmp_path / "adam.npz") == tmp_path / "adam.npz"
    assert LearnedOptimizer.load(tmp_path / "adam").rule == adam.rule


def test_dotted_names_are_different_files(tmp_path):
    first = _small_optimizer(train_horizon=10).save(None, tmp_path / "lopt.v1")
    second = _small_optimizer(train_horizon=20, seed=4).save(None, str(tmp_path / "lopt.v2"))
    assert (first, second) == (tmp_path / "lopt.v1.npz", tmp_path / "lopt.v2.npz")
    assert sorted(os.listdir(tmp_path)) == ["lopt.v1.npz", "lopt.v2.npz"]
    assert LearnedOptimizer.load(tmp_path / "lopt.v1").train_horizon == 10
    assert LearnedOptimizer.load(tmp_path / "lopt.v2.npz").train_horizon == 20


def _times(factor):
    return lambda meta_params: jax.tree.map(lambda x: factor * x, meta_params)


BAD_SAVES = {
    # case: (rule, meta-params from the good ones, train_horizon, info, error, message)
    "numpy scalar in info": (MLPUpdateRule(hidden_sizes=(8, 4), decays=(0.5, 0.9), step_mult=1e-2), _times(3), 999,
                             {"t": np.float32(1)}, TypeError, r"config\['info'\]\['t'\]: float32"),
    "NaN in info": (None, _times(3), 50, {"loss": float("nan")}, ValueError, r"config\['info'\]\['loss'\]: nan"),
    "numpy train_horizon": (None, _times(3), np.int64(5), {}, TypeError, r"config\['train_horizon'\]: int64"),
    "object in info": (None, _times(3), 50, {"rule": MLPUpdateRule()}, TypeError, r"config\['info'\]\['rule'\]"),
    "non-str key in info": (None, _times(3), 50, {1: 2.0}, TypeError, r"config\['info'\]: key 1"),
    "int meta-params": (None, lambda p: jax.tree.map(lambda x: np.asarray(x).astype(np.int32), p), 50, {}, TypeError,
                        r"meta_params\['layers'\]\[0\]\['b'\]: dtype int32"),
    "object meta-params": (None, lambda p: jax.tree.map(lambda x: np.asarray(x).astype(object), p), 50, {},
                           TypeError, "dtype object"),
    "NaN meta-params": (None, lambda p: {**p, "skip": p["skip"] * np.nan}, 50, {}, ValueError,
                        r"meta_params\['skip'\]: holds NaN"),
}


@pytest.mark.parametrize("case", sorted(BAD_SAVES))
def test_failing_save_leaves_previous_file_untouched(tmp_path, case):
    good = _small_optimizer()
    path = good.save(None, tmp_path / "p")
    before = path.read_bytes()
    rule, transform, train_horizon, info, error, message = BAD_SAVES[case]
    bad = LearnedOptimizer(rule or good.rule, None, 50, info)
    # Attributes as a caller may set them (the constructor itself converts numpy ints): save must still refuse.
    bad.meta_params, bad.train_horizon = transform(good.meta_params), train_horizon
    with pytest.raises(error, match=message):
        bad.save(None, tmp_path / "p")
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["p.npz"]
    loaded = LearnedOptimizer.load(tmp_path / "p")
    assert loaded.rule == good.rule and loaded.train_horizon == 50 and loaded.info == {}


def test_failing_write_leaves_no_temporary_file(tmp_path):
    (tmp_path / "taken.npz").mkdir()  # the rename onto a directory fails after the temp file is written
    with pytest.raises(OSError):
        _small_optimizer().save(None, tmp_path / "taken")
    assert sorted(os.listdir(tmp_path)) == ["taken.npz"] and not os.listdir(tmp_path / "taken.npz")


def _rewrite(file, edit_entries=None, edit_description=None, raw_description=None, consistent=True, seal=True):
    """Rewrite ``file`` with its entries and JSON description changed by the given functions.

    ``consistent``: as a buggy writer would, record the edited entries' checksums and checksum the
    edited description (so the checks behind the checksums are reached); else keep the old ones.
    ``seal``: seal the rewritten archive (so the checks behind the seal are reached)."""
    entries = _entries(file)
    raw = entries.pop("__carlskit__").tobytes()
    description = loads_checked_json(raw)
    if edit_entries is not None:
        entries = edit_entries(entries)
        if consistent:
            description["leaves"] = {name: _leaf_record(array) for name, array in entries.items()}
    if edit_description is not None:
        description = edit_description(description)
    if raw_description is not None:
        text = raw_description
    elif consistent:
        text = dumps_checked_json(description)
    else:
        document = json.loads(raw)
        document["content"] = description
        text = json.dumps(document, indent=1, sort_keys=True, allow_nan=False).encode()  # the writer's layout
    if text is not False:
        entries["__carlskit__"] = np.frombuffer(text, np.uint8)
    data = arrays_to_npz_bytes(entries)
    file.write_bytes(seal_zip(data) if seal else data)


def _flip_a_weight_bit(file):
    data = bytearray(file.read_bytes())
    weights = _entries(file)["leaf_1"].tobytes()
    at = data.find(weights) + len(weights) // 2
    data[at] ^= 0x10
    file.write_bytes(bytes(data))


def _flip_a_description_byte(file):
    """Flip one byte of the description's JSON inside the zip (then fix zip's CRC and the seal, as a
    careful attacker or a buggy copier would): only the JSON's own SHA-256 can notice."""
    entries = _entries(file)
    text = bytearray(entries["__carlskit__"].tobytes())
    at = text.index(b'"train_horizon": 50') + len(b'"train_horizon": ')
    text[at] = ord("7")  # 50 -> 70
    entries["__carlskit__"] = np.frombuffer(bytes(text), np.uint8)
    file.write_bytes(seal_zip(arrays_to_npz_bytes(entries)))


def _npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _edit_config(change):
    def edit(description):
        change(description["config"])
        return description
    return edit


CORRUPTIONS = {
    "truncated": (lambda f: f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2]), "BadZipFile"),
    "empty": (lambda f: f.write_bytes(b""), "empty file"),
    "garbage": (lambda f: f.write_bytes(b"not an npz at all" * 10), "not an .npz (zip) archive"),
    "bit flip": (_flip_a_weight_bit, "SHA-256 seal"),
    "unsealed current format": (lambda f: _rewrite(f, seal=False), "format_version 4 file without its SHA-256 seal"),
    "plain npy": (lambda f: f.write_bytes(_npy_bytes(np.zeros(3))), "not an .npz (zip) archive"),
    "truncated header": (lambda f: f.write_bytes(f.read_bytes()[:40]), "BadZipFile"),
    "no description": (lambda f: _rewrite(f, raw_description=False), "no '__carlskit__' entry"),
    "truncated JSON": (lambda f: _rewrite(f, raw_description=b'{"format_version": 2, "struct'), "bad JSON"),
    "NaN in JSON": (lambda f: _rewrite(f, raw_description=b'{"format_version": NaN}'), "NaN"),
    "plain JSON description": (lambda f: _rewrite(f, raw_description=b'{"structure": {}, "config": {}}'),
                               "not a checksummed"),
    "edited config, old checksum": (lambda f: _rewrite(f, edit_description=_edit_config(
        lambda c: c.update(train_horizon=51)), consistent=False), "does not match its SHA-256"),
    "flipped byte in JSON": (lambda f: _flip_a_description_byte(f), "JSON description"),
    "entry rewritten with a valid CRC": (lambda f: _rewrite(f, edit_entries=lambda e: {
        **e, "leaf_1": e["leaf_1"] + 1.0}, consistent=False), "'leaf_1' differs from its recorded"),
    "JSON list": (lambda f: _rewrite(f, raw_description=b"[1, 2]"), "not a checksummed"),
    "missing structure": (lambda f: _rewrite(f, edit_description=lambda d: {k: v for k, v in d.items()
                                                                           if k != "structure"}), "structure"),
    "old format_version": (lambda f: _rewrite(f, raw_description=b'{"format_version": 1}'), "format_version 1"),
    "newer format_version": (lambda f: _rewrite(f, edit_description=lambda d: {**d, "format_version": 5}),
                             "format_version 5"),
    "bad structure node": (lambda f: _rewrite(f, edit_description=lambda d: {**d, "structure": {"dict": 5}}),
                           "bad structure node"),
    "leaf listed twice": (lambda f: _rewrite(f, edit_description=lambda d: {**d, "structure": {"list": [
        "leaf:0", "leaf:0"]}}), "twice"),
    "missing rule": (lambda f: _rewrite(f, edit_description=_edit_config(lambda c: c.pop("rule"))), "'rule'"),
    "unknown rule field": (lambda f: _rewrite(f, edit_description=_edit_config(
        lambda c: c["rule"].update(momentum=0.9))), "momentum"),
    "bad train_horizon": (lambda f: _rewrite(f, edit_description=_edit_config(
        lambda c: c.update(train_horizon="50"))), "train_horizon"),
    "missing leaf": (lambda f: _rewrite(f, edit_entries=lambda e: {k: v for k, v in e.items() if k != "leaf_6"}),
                     "leaf:6"),
    "extra leaf": (lambda f: _rewrite(f, edit_entries=lambda e: {**e, "leaf_99": np.zeros(2, np.float32)}),
                   "leaf_99"),
    "int leaf": (lambda f: _rewrite(f, edit_entries=lambda e: {**e, "leaf_0": e["leaf_0"].astype(np.int32)}),
                 "int32"),
    "wrong leaf shape": (lambda f: _rewrite(f, edit_entries=lambda e: {**e, "leaf_0": e["leaf_0"][:-1]}),
                         "do not fit"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_file_raises_value_error_naming_it(tmp_path, case):
    file = _small_optimizer().save(None, tmp_path / "opt")
    corrupt, problem = CORRUPTIONS[case]
    corrupt(file)
    with pytest.raises(CorruptFileError) as raised:
        LearnedOptimizer.load(tmp_path / "opt")
    assert str(raised.value).startswith(f"{file}: ") and problem in str(raised.value), str(raised.value)
    assert raised.value.path == str(file)


def test_format_2_files_without_checksums_still_load_with_a_warning(tmp_path):
    optimizer = _small_optimizer()
    file = optimizer.save(None, tmp_path / "old")
    entries = _entries(file)
    document = loads_checked_json(entries.pop("__carlskit__").tobytes())
    legacy = {"format_version": 2, "structure": document["structure"], "config": document["config"]}
    entries["__carlskit__"] = np.frombuffer(json.dumps(legacy).encode(), np.uint8)
    np.savez(file, allow_pickle=False, **entries)
    with pytest.warns(UserWarning, match="format_version 2 has no checksums"):
        loaded = LearnedOptimizer.load(file)
    for a, b in zip(jax.tree.leaves(loaded.meta_params), jax.tree.leaves(optimizer.meta_params)):
        np.testing.assert_array_equal(a, b)


def test_format_3_files_without_a_seal_still_load_with_a_warning(tmp_path):
    optimizer = _small_optimizer()
    file = optimizer.save(None, tmp_path / "unsealed")
    _rewrite(file, edit_description=lambda d: {**d, "format_version": 3}, seal=False)
    with pytest.warns(UserWarning, match="format_version 3 has no SHA-256 seal"):
        loaded = LearnedOptimizer.load(file)
    for a, b in zip(jax.tree.leaves(loaded.meta_params), jax.tree.leaves(optimizer.meta_params)):
        np.testing.assert_array_equal(a, b)


def test_every_single_bit_flip_is_refused(tmp_path):
    """All 8 x len(file) single-bit flips of a saved LearnableAdam raise CorruptFileError: the seal
    covers the zip container too (format 3 let 349 of them, in local headers and the central
    directory, load). The shipped file is sealed too."""
    file = LearnableAdam().save(None, tmp_path / "m.npz")
    good = file.read_bytes()
    LearnedOptimizer.load(file)
    refused = 0
    for at in range(len(good)):  # in memory: the loader's code after reading the file
        for bit in range(8):
            data = bytearray(good)
            data[at] ^= 1 << bit
            with pytest.raises(CorruptFileError):
                meta_params_from_bytes(bytes(data), file)
            refused += 1
    assert refused == 8 * len(good) > 8 * 2000
    rng = np.random.default_rng(0)
    for at, bit in zip(rng.integers(0, len(good), 64), rng.integers(0, 8, 64)):  # and through the file
        data = bytearray(good)
        data[at] ^= 1 << int(bit)
        file.write_bytes(bytes(data))
        with pytest.raises(CorruptFileError):
            LearnedOptimizer.load(file)
    import importlib.resources
    shipped = (importlib.resources.files("carlskit.lopt") / "pretrained_mlp_lopt.npz").read_bytes()
    check_seal(shipped)


def test_pretrained_ships_and_works_with_no_meta_training():
    optimizer = LearnedOptimizer.pretrained()
    assert optimizer.train_horizon == 200 and optimizer.info["outer_steps"] > 0
    tx = optimizer.as_optax()
    loss = lambda p: jnp.sum(jnp.square(p["w"] - 1.0)) + jnp.sum(jnp.square(p["b"]))
    params = {"w": jnp.zeros((4, 3)), "b": jnp.ones((3,))}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    start = loss(params)
    for _ in range(20):
        params, state = step(params, state)
    assert float(loss(params)) < float(start)


def test_pretrained_carries_its_command_compute_and_held_out_table():
    """The shipped file says how it was made (train_pretrained on the MetaTraining cluster) and what it
    scored on the held-out problems; notebook 06 re-runs part of that table live."""
    from carlskit.lopt import HierarchicalRule, geometric_mean_ratio, held_out_problems

    optimizer = LearnedOptimizer.pretrained()
    info = optimizer.info
    assert isinstance(optimizer.rule, HierarchicalRule)
    assert info["command"].startswith("python -m carlskit.lopt.train_pretrained")
    assert info["compute"]["outer_steps"] > 1000 and info["compute"]["wall_seconds"] > 0
    assert info["compute"]["cpu_hours"] > 0 and info["compute"]["gradients_applied"] > 0
    rows = info["comparison"]
    assert [row["problem"] for row in rows] == list(held_out_problems()) and len(rows) >= 6
    for row in rows:
        assert row["learned"] is not None and row["tuned_adam"] is not None  # null = diverged
        assert abs(row["ratio"] - row["learned"] / row["tuned_adam"]) < 1e-9
    assert abs(geometric_mean_ratio(rows) - info["geomean_vs_tuned_adam"]) < 1e-9
    assert geometric_mean_ratio(rows) <= 0.9
    assert str(info["checkpoint"]) in info["evaluation"]


def test_pretrained_is_one_file():
    import importlib.resources
    package = importlib.resources.files("carlskit.lopt")
    assert (package / "pretrained_mlp_lopt.npz").is_file()
    assert not (package / "pretrained_mlp_lopt.json").is_file()
