"""Gradient store and learner of the meta-training cluster, in-process (no Dask)."""

import logging

import jax
import numpy as np
import optax
import pytest

from carlskit.lopt import GradientStore, LearnableAdamRule, Learner

RULE = LearnableAdamRule()


def record(outer_step, grad, family="quad", id=None, loss=1.0):
    return {"id": id or f"{outer_step}-{np.random.default_rng().integers(1 << 60)}",
            "grad": [np.asarray(g, np.float32) for g in grad], "outer_step": outer_step,
            "task_family": family, "losses": np.zeros((2, 2)), "outer_loss": loss, "worker": 0, "seconds": 0.0}


def leaves(learner):
    return [np.asarray(x) for x in learner.current()[1]]


def grad_like(learner, value):
    return [np.full(np.shape(x), value, np.float32) for x in learner.current()[1]]


def make_learner(tmp_path, store=None, **options):
    options.setdefault("outer_optimizer", optax.sgd(1.0))
    return Learner(RULE, GradientStore() if store is None else store, str(tmp_path / "ckpt"), **options)


def test_store_puts_and_takes_batches_oldest_first_once_per_id():
    store = GradientStore(max_records=3)
    assert store.put_many([{"id": "a"}, {"id": "b"}, {"id": "a"}]) == 2
    assert store.put_many([{"id": "c"}, {"id": "d"}]) == 2  # "a" overflows: oldest dropped
    assert [r["id"] for r in store.take_many(2)] == ["b", "c"]
    assert [r["id"] for r in store.take_many(10)] == ["d"] and store.take_many(5) == []
    assert store.status() == {"pending": 0, "puts": 4, "takes": 3, "overflowed": 1, "duplicates": 1}
    with pytest.raises(TypeError, match="records"):
        store.put_many([{"no_id": 1}])
    with pytest.raises(ValueError, match="max_records"):
        store.take_many(0)


def test_store_put_many_checks_the_whole_batch_before_storing_any():
    store = GradientStore()
    with pytest.raises(TypeError, match=r"records\[1\]"):
        store.put_many([{"id": "ok"}, "bad"])
    with pytest.raises(TypeError, match=r"records\[1\].*\['x'\]"):
        store.put_many([{"id": "ok"}, {"id": ["x"]}])  # unhashable id
    assert store.status() == {"pending": 0, "puts": 0, "takes": 0, "overflowed": 0, "duplicates": 0}
    assert store.put_many([{"id": "ok"}, {"id": "next"}]) == 2
    assert [r["id"] for r in store.take_many(np.int64(1))] == ["ok"]  # numpy ints are ints
    for bad, error in ((True, TypeError), (2.0, TypeError), (0, ValueError)):
        with pytest.raises(error, match="max_records"):
            GradientStore(bad)
        with pytest.raises(error, match="max_records"):
            store.take_many(bad)
    assert store.size() == 1


def test_learner_rejects_each_malformed_record_and_applies_the_good_ones_of_the_batch(tmp_path, caplog):
    store = GradientStore()
    learner = make_learner(tmp_path, store)
    start = leaves(learner)
    good = record(0, grad_like(learner, 2.0), loss=3.0)
    bad = {"outer_loss": [], "outer_step": [], "task_family": [], "dtype": []}
    for field in ("outer_loss", "task_family"):
        missing = record(0, grad_like(learner, 1.0))
        del missing[field]
        bad[field].append(missing)
    for loss in ("x", None, np.nan, np.inf, True, [1.0, 2.0]):
        bad["outer_loss"].append(record(0, grad_like(learner, 1.0), loss=loss))
    for step in ("abc", None, 1.7, -3, True):
        bad["outer_step"].append(record(step, grad_like(learner, 1.0), id=f"step-{step!r}"))
    bad["task_family"].append(record(0, grad_like(learner, 1.0), family=7))
    for dtype in ("U3", complex, bool, object):
        bad["dtype"].append({**record(0, grad_like(learner, 1.0)),
                             "grad": [np.zeros(np.shape(x), dtype) for x in grad_like(learner, 1.0)]})
    batch = [r for records in bad.values() for r in records]
    batch.insert(len(batch) // 2, good)
    store.put_many(batch)
    with caplog.at_level(logging.WARNING, logger="carlskit.lopt.learner"):
        result = learner.update()
    assert (result["taken"], result["applied"], result["rejected"]) == (len(batch), 1, len(batch) - 1)
    status = learner.status()
    assert {k: v for k, v in status["rejected"].items() if v} == {k: len(v) for k, v in bad.items()}
    assert "step-1.7" in caplog.text and "outer_step" in caplog.text
    assert status["outer_step"] == 1 and status["applied"] == 1 and status["received"] == 1
    assert status["outer_loss"] == 3.0 and status["family_losses"] == {"quad": {"loss": 3.0, "count": 1}}
    for got, want in zip(leaves(learner), start):  # SGD(1) with the good gradient only
        np.testing.assert_allclose(got, want - 2.0, rtol=1e-6)
    # A batch of only bad records changes nothing but the counts.
    store.put_many([record(1, grad_like(learner, 1.0), loss=np.nan)])
    assert learner.update()["rejected"] == 1 and learner.current()[0] == 1
    assert learner.status()["family_losses"]["quad"]["loss"] == 3.0, "a NaN loss never enters the family EMA"


def test_learner_resumes_counts_from_a_checkpoint_written_with_fewer_rejection_reasons(tmp_path):
    learner = make_learner(tmp_path)
    old_counts = {"shape": 2, "non_finite": 1, "future_step": 0}
    learner.checkpoints.save({"meta_params": learner.meta_params, "outer_state": learner.outer_state}, version=1,
                             metadata={"learner": {"rejected": old_counts}})
    store = GradientStore()
    resumed = make_learner(tmp_path, store)
    assert resumed.status()["rejected"]["shape"] == 2 and resumed.status()["rejected"]["outer_loss"] == 0
    store.put_many([record(1, grad_like(resumed, 1.0), loss=np.nan)])
    assert resumed.update()["rejected"] == 1 and resumed.status()["rejected"]["outer_loss"] == 1


def test_learner_averages_fresh_gradients_and_drops_stale_ones(tmp_path):
    store = GradientStore()
    learner = make_learner(tmp_path, store, max_staleness=1)
    start = leaves(learner)
    store.put_many([record(0, grad_like(learner, 1.0)), record(0, grad_like(learner, 3.0), family="other")])
    assert learner.update()["applied"] == 2
    # SGD(1): theta <- theta - mean(grad) = theta - 2
    np.testing.assert_allclose(np.concatenate([a.ravel() for a in leaves(learner)]),
                               np.concatenate([a.ravel() - 2.0 for a in start]), rtol=1e-6)
    for _ in range(2):  # two more steps at a fresh gradient of 0
        store.put_many([record(learner.current()[0], grad_like(learner, 0.0))])
        learner.update()
    assert learner.current()[0] == 3
    after = leaves(learner)
    # staleness 3 - 1 = 2 > 1 is dropped; 3 - 2 = 1 is applied
    store.put_many([record(1, grad_like(learner, 100.0)), record(2, grad_like(learner, 0.5))])
    result = learner.update()
    assert (result["applied"], result["dropped_stale"]) == (1, 1)
    np.testing.assert_allclose(leaves(learner)[0], after[0] - 0.5, rtol=1e-6)
    status = learner.status()
    assert status["received"] == 6 and status["dropped_stale"] == 1
    assert status["staleness_counts"][:3] == [4, 1, 1] and status["dropped_fraction"] == pytest.approx(1 / 6)
    assert set(status["family_losses"]) == {"quad", "other"}


def test_learner_rejects_nan_and_wrong_shape_gradients_counts_and_logs_them(tmp_path, caplog):
    store = GradientStore()
    learner = make_learner(tmp_path, store)
    start = leaves(learner)
    nan = grad_like(learner, 1.0)
    nan[0] = np.full_like(nan[0], np.nan)
    wrong_shape = grad_like(learner, 1.0)
    wrong_shape[-1] = np.zeros((3, 3), np.float32)
    with caplog.at_level(logging.WARNING, logger="carlskit.lopt.learner"):
        store.put_many([record(0, nan, id="nan-one"), record(0, wrong_shape, id="bad-shape"),
                        record(0, grad_like(learner, 1.0)[:-1], id="too-few"), record(7, grad_like(learner, 1.0))])
        result = learner.update()
    assert (result["applied"], result["rejected"]) == (0, 4)
    assert {k: v for k, v in learner.status()["rejected"].items() if v} == {"shape": 2, "non_finite": 1,
                                                                            "future_step": 1}
    assert "nan-one" in caplog.text and "bad-shape" in caplog.text
    assert learner.current()[0] == 0
    for got, want in zip(leaves(learner), start):
        np.testing.assert_array_equal(got, want)


def test_a_new_learner_resumes_from_the_latest_checkpoint(tmp_path):
    store = GradientStore()
    learner = make_learner(tmp_path, store, outer_optimizer=optax.adam(0.1), checkpoint_every_seconds=1e-6)
    for value in (1.0, -2.0, 0.5):
        store.put_many([record(learner.current()[0], grad_like(learner, value))])
        learner.update()
    assert learner.checkpoints.versions() == [0, 1, 2, 3]
    resumed = make_learner(tmp_path, store, outer_optimizer=optax.adam(0.1))
    assert resumed.resumed_from == 3 and resumed.current()[0] == 3
    for got, want in zip(leaves(resumed), leaves(learner)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(jax.tree.leaves(resumed.outer_state), jax.tree.leaves(learner.outer_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # Adam's moments too
    assert resumed.status()["received"] == 3
    # both continue identically from the same gradient
    for one in (learner, resumed):
        store.put_many([record(3, grad_like(one, 0.25))])
        one.update()
    for got, want in zip(leaves(resumed), leaves(learner)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_learner_validates_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_staleness"):
        make_learner(tmp_path, max_staleness=-1)
    with pytest.raises(ValueError, match="initial_meta_params"):
        make_learner(tmp_path, initial_meta_params={"wrong": np.zeros(3)})
    with pytest.raises(TypeError, match="checkpoint_every_seconds"):
        make_learner(tmp_path, checkpoint_every_seconds="x")
    with pytest.raises(TypeError, match="max_staleness"):
        make_learner(tmp_path, max_staleness=True)
    theta = RULE.init_meta_params(jax.random.PRNGKey(0))
    first = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(theta)[0][0][0])
    nan_theta = jax.tree.map(lambda x: np.full(np.shape(x), np.nan, np.float32), theta)
    for bad, error, match in ((jax.tree.map(lambda x: np.asarray(x).astype(np.int32), theta), TypeError, "floating"),
                              (jax.tree.map(lambda x: np.full(np.shape(x), "a"), theta), TypeError, "floating"),
                              (nan_theta, ValueError, "finite")):
        with pytest.raises(error, match=match) as raised:
            make_learner(tmp_path, initial_meta_params=bad)
        assert f"initial_meta_params{first}" in str(raised.value)
    assert not (tmp_path / "ckpt").exists(), "no checkpoint directory is created for rejected arguments"


def test_a_new_learner_falls_back_to_the_newest_intact_checkpoint_and_never_starts_over(tmp_path):
    store = GradientStore()
    learner = make_learner(tmp_path, store, checkpoint_every_seconds=1e-6)
    for value in (1.0, -2.0, 0.5):
        store.put_many([record(learner.current()[0], grad_like(learner, value))])
        learner.update()
    at_two = leaves(make_learner(tmp_path, store))  # resumes at checkpoint 3: same as checkpoint 2 + one step
    ckpt = tmp_path / "ckpt"
    newest = ckpt / f"v{3:012d}.npz"
    newest.write_bytes(newest.read_bytes()[:60])  # the newest checkpoint is damaged
    resumed = make_learner(tmp_path, store)
    assert resumed.resumed_from == 2 and list(resumed.skipped_checkpoints) == [3]
    assert resumed.status()["skipped_checkpoints"][3] and resumed.current()[0] == 2
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(resumed), at_two)), "the older meta-parameters"
    for version in (0, 1, 2):
        data = (ckpt / f"v{version:012d}.npz").read_bytes()
        (ckpt / f"v{version:012d}.npz").write_bytes(data[:60])
    with pytest.raises(ValueError, match="corrupt"):  # none intact: refuses instead of restarting at 0
        make_learner(tmp_path, store)


def test_a_resumed_learner_writes_each_summary_step_once_and_the_first_write_stands(tmp_path):
    from carlskit.summaries import SummaryReader

    store, logdir = GradientStore(), str(tmp_path / "summaries")
    first = make_learner(tmp_path, store, checkpoint_every_seconds=3600, logdir=logdir)
    for value in (1.0, -2.0, 0.5, 0.25, 4.0):  # steps 1..5 logged, only checkpoint 0 written
        store.put_many([record(first.current()[0], grad_like(first, value), loss=value)])
        first.update()
    first._writer.close()  # its writer flushed; then the learner is lost (no close(): no checkpoint)
    resumed = make_learner(tmp_path, store, logdir=logdir, checkpoint_every_seconds=3600)
    assert resumed.resumed_from == 0 and resumed.summary_floor == 5
    for value in (3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0):  # steps 1..7 again, with other values
        store.put_many([record(resumed.current()[0], grad_like(resumed, value), loss=value)])
        resumed.update()
    resumed.close()
    frame = SummaryReader(logdir).scalars("learner/outer_loss")
    assert list(frame["step"]) == [1, 2, 3, 4, 5, 6, 7], "every step once"
    assert list(frame["value"]) == [1.0, -2.0, 0.5, 0.25, 4.0, 3.0, 3.0], "the first write of a step stands"
    assert resumed.status()["summaries_skipped"] == 5


def test_learned_optimizer_of_a_run_skips_a_damaged_newest_checkpoint(tmp_path):
    from carlskit.lopt import LearnableAdam, MetaTraining, QuadraticTask

    store = GradientStore()
    learner = Learner(RULE, store, str(tmp_path / "checkpoints"), checkpoint_every_seconds=1e-6)
    for value in (1.0, -2.0):
        store.put_many([record(learner.current()[0], grad_like(learner, value))])
        learner.update()
    newest = tmp_path / "checkpoints" / f"v{2:012d}.npz"
    newest.write_bytes(newest.read_bytes()[:80])
    training = MetaTraining(LearnableAdam(), QuadraticTask(4, 10.0, 0.1), None, directory=tmp_path)
    assert training.learned_optimizer().info["checkpoint"] == 1
    with pytest.raises(ValueError, match="corrupt"):
        training.learned_optimizer(2)  # asked for by version: no silent substitute


def test_service_placements_take_a_default_and_per_role_overrides_by_name():
    from carlskit.cluster import Placement
    from carlskit.lopt._meta_training import service_placements

    placements = service_placements(None, {"cpu_pool": 1}, {"learner": {"workers": ["learner-0"]}})
    assert placements["learner"] == Placement(("learner-0",), None)
    assert placements["es_workers"] == placements["eval_workers"] == Placement(None, {"cpu_pool": 1})
    assert service_placements(None, None, None)["learner"] == Placement()
    with pytest.raises(ValueError, match=r"unknown roles \['trainer'\]"):
        service_placements(None, None, {"trainer": {}})
    with pytest.raises(ValueError, match=r"placement\['learner'\] has unknown keys \['gpus'\]"):
        service_placements(None, None, {"learner": {"gpus": 1}})
    with pytest.raises(TypeError, match=r"placement\['es_workers'\] must be a Placement or a dict"):
        service_placements(None, None, {"es_workers": 3})
    with pytest.raises(ValueError, match=r"resources\['GPU'\] must be a (finite )?number > 0"):
        service_placements(None, {"GPU": 0}, None)


def test_per_family_loss_and_gradient_variance_are_summarised_and_read_back(tmp_path):
    from carlskit.summaries import SummaryReader

    store = GradientStore()
    learner = make_learner(tmp_path, store, logdir=str(tmp_path / "logs"), max_staleness=10)
    rng = np.random.default_rng(0)
    sent = {"quad": [], "mlp/digits": []}
    for step in range(3):
        batch = []
        for family, scale, loss in (("quad", 0.1, 1.0 + step), ("mlp/digits", 10.0, 5.0)):
            grad = [rng.normal(0, scale, np.shape(x)).astype(np.float32) for x in learner.current()[1]]
            sent[family].append((np.concatenate([g.ravel() for g in grad]), loss))
            batch.append(record(step, grad, family, loss=loss))
        store.put_many(batch)
        learner.update()
    learner.close()
    rows = {row["task_family"]: row for row in learner.status()["families"]}
    reader = SummaryReader(str(tmp_path / "logs"))
    for family, values in sent.items():
        grads, losses = np.stack([g for g, _ in values]), [loss for _, loss in values]
        variance = float(np.var(grads, axis=0, ddof=1).mean())
        np.testing.assert_allclose(rows[family]["grad_variance"], variance, rtol=1e-5)
        assert rows[family]["loss_all"] == pytest.approx(np.mean(losses))
        assert rows[family]["loss_latest"] == losses[-1] and rows[family]["count"] == 3
        label = family.replace("/", "|")
        assert list(reader.scalars(f"family/{label}/loss_all")["value"]) == pytest.approx(
            [np.mean(losses[:k]) for k in (1, 2, 3)])
        assert list(reader.scalars(f"family/{label}/loss_latest")["step"]) == [1, 2, 3]
        logged = reader.scalars(f"family/{label}/grad_variance")["value"].to_numpy()
        assert logged[-1] == pytest.approx(variance, rel=1e-5)
    # The noisy family stands out: its gradient variance is 10^4 x the quiet one's.
    assert rows["mlp/digits"]["grad_variance"] > 1e3 * rows["quad"]["grad_variance"]
    # A learner resumed from the checkpoint continues the figures.
    resumed = make_learner(tmp_path, GradientStore())
    assert {r["task_family"]: r for r in resumed.status()["families"]}["quad"]["count"] == 3
