"""LabelMaker: mined labels and confidences from each checkpoint, written with its version."""

import functools

import numpy as np
import optax
from process_helpers import wait_until

from carlskit.bank import KnowledgeBank
from carlskit.makers import LabelMaker, Maker
from carlskit.paradigms.graph_reg import MLP
from carlskit.training import CheckpointStore, MinedLabels, Trainer, masked_cross_entropy


def loss(model, batch):
    logits = model(batch["features"])
    return masked_cross_entropy(logits, batch["labels"], np.ones(len(batch["labels"]), bool)), {}


def test_label_maker_writes_confidences_in_unit_interval_with_increasing_versions(tmp_path):
    rng = np.random.default_rng(0)
    features = rng.normal(size=(300, 8)).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int32) + 2 * (features[:, 1] > 0)
    make_model = functools.partial(MLP, 8, 16, 4, dropout=0.5, seed=0)
    bank = KnowledgeBank()
    bank.create_feature_table("labels", schema=LabelMaker.SCHEMA)
    store = CheckpointStore(tmp_path, keep=None)
    trainer = Trainer(make_model(), optax.adam(0.05), loss, checkpoints=store, checkpoint_every=1000)
    items = np.arange(300)
    maker = Maker(LabelMaker(make_model, features, batch_size=128), items, num_slices=2, poll_seconds=0.01)
    trainer.save_checkpoint()
    maker.start(store, bank)
    seen = []
    try:
        for round_ in range(3):
            wait_until(lambda: (bank.row_metadata("labels", items)["version"] == trainer.step).all())
            records, found = bank.lookup("labels", items)
            assert found.all()
            assert records["label"].dtype == np.int64 and records["label"].shape == (300, 1)
            assert ((records["label"] >= 0) & (records["label"] < 4)).all()
            confidence = records["confidence"][:, 0]
            assert confidence.dtype == np.float32 and ((confidence >= 0.25 - 1e-6) & (confidence <= 1.0)).all()
            seen.append((trainer.step, float(np.mean(records["label"][:, 0] == labels))))
            stage = MinedLabels(bank, "labels")(({"ids": items}))
            assert stage["_mined_version"] == trainer.step
            np.testing.assert_array_equal(stage["mined_labels"], records["label"][:, 0])
            trainer.fit(lambda step: {"features": features, "labels": labels}, 40, live=False)
            trainer.save_checkpoint()
    finally:
        maker.stop()
    assert maker.status()["errors"] == []
    versions = [version for version, _ in seen]
    assert versions == sorted(versions) and len(set(versions)) == 3
    assert seen[-1][1] > 0.8 > seen[0][1], f"mined labels follow the trained model: {seen}"


def test_mined_labels_of_absent_items_have_zero_confidence():
    bank = KnowledgeBank()
    bank.create_feature_table("labels", schema=LabelMaker.SCHEMA)
    bank.update("labels", [1], {"label": [[7]], "confidence": [[0.9]]}, version=5)
    batch = MinedLabels(bank)({"ids": np.array([1, 2])})
    np.testing.assert_array_equal(batch["mined_labels"], [7, 0])
    np.testing.assert_allclose(batch["mined_confidence"], [0.9, 0.0])
    assert batch["_mined_version"] == 5
