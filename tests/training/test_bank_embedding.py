"""Bank-trained embeddings: a Trainer whose embedding table lives in the bank equals an all-nnx.Embed
model trained by optax (SGD, Adagrad), and bad ids are refused before anything is written."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from carlskit import KnowledgeBank
from carlskit.training import BankEmbedding, BankEmbeddings, Trainer

NUM_IDS, DIM, BATCH, STEPS, LR = 40, 8, 16, 20, 0.05


class BankModel(nnx.Module):
    """score = <emb(ids), w> + b, the embedding in bank table "items"."""

    def __init__(self):
        self.embed = BankEmbedding("items", DIM)
        self.head = nnx.Linear(DIM, 1, rngs=nnx.Rngs(1))

    def __call__(self, batch):
        return self.head(self.embed(batch, "ids"))[:, 0]


class EmbedModel(nnx.Module):
    """The same model with an in-device nnx.Embed (the peer)."""

    def __init__(self, table):
        self.embed = nnx.Embed(NUM_IDS, DIM, rngs=nnx.Rngs(0))
        self.embed.embedding[...] = jnp.asarray(table)
        self.head = nnx.Linear(DIM, 1, rngs=nnx.Rngs(1))

    def __call__(self, batch):
        return self.head(self.embed(batch["ids"]))[:, 0]


def loss_fn(model, batch):
    loss = jnp.mean((model(batch) - batch["y"]) ** 2)
    return loss, {}


def batches():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        ids = rng.integers(0, NUM_IDS // 2, BATCH)  # 16 draws of 20 ids: repeats in every batch
        ids[:4] = ids[4]
        out.append({"ids": ids.astype(np.int32), "y": np.cos(1.3 * ids).astype(np.float32)})  # learnable per id
    return out


@pytest.mark.parametrize("table_optimizer", ["sgd", "adagrad"])
def test_bank_table_trained_like_nnx_embed_with_optax(table_optimizer):
    data = batches()
    bank = KnowledgeBank()
    # max_pending=1: every gradient is applied when it arrives (no lazy cache)
    bank.create_table("items", DIM, optimizer=table_optimizer, learning_rate=LR, max_pending=1)
    stage = BankEmbeddings(bank, {"items": ["ids"]}, max_staleness=0)
    initial, _ = bank.lookup("items", np.arange(NUM_IDS))  # the initializer's values, no row created
    # Adagrad: the bank's accumulator starts at initial_accumulator_value (0.1) and adds epsilon (1e-7)
    # inside the square root, as optax.adagrad's defaults do (written out here): no intended difference.
    tx = optax.sgd(LR) if table_optimizer == "sgd" else optax.adagrad(LR, initial_accumulator_value=0.1, eps=1e-7)
    trainer = Trainer(BankModel(), tx, loss_fn, knowledge=stage, prefetch=2)
    history = trainer.fit(data, STEPS, progress=False, live=False)

    from carlskit.bank._hashing import initial_values
    config = bank.tables["items"]
    table = initial_values(np.arange(NUM_IDS), DIM, config["initializer"], config["seed"], config["init_scale"])
    assert not initial.any()  # lookup without insert_missing reads zeros for absent keys
    peer = EmbedModel(table)
    optimizer = nnx.Optimizer(peer, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(peer, optimizer, {k: jnp.asarray(v) for k, v in b.items()})) for b in data]
    np.testing.assert_allclose([r["loss"] for r in history], losses, rtol=1e-5, atol=1e-6)
    seen = np.unique(np.concatenate([b["ids"] for b in data]))
    rows, found = bank.lookup("items", seen)
    assert found.all()
    np.testing.assert_allclose(rows, np.asarray(peer.embed.embedding[...])[seen], atol=1e-5)
    np.testing.assert_allclose(trainer.model.head.kernel[...], peer.head.kernel[...], atol=1e-5)
    np.testing.assert_allclose(trainer.model.head.bias[...], peer.head.bias[...], atol=1e-5)
    stats = bank.stats()["tables"]["items"]
    assert stats["rows"] == len(seen)
    assert stats["optimizer_steps"] == sum(len(np.unique(b["ids"])) for b in data)


def test_default_staleness_overlaps_lookups_and_still_learns():
    data = batches()
    bank = KnowledgeBank()
    bank.create_table("items", DIM, learning_rate=1.0, max_pending=1)
    trainer = Trainer(BankModel(), optax.sgd(0.2), loss_fn, knowledge=BankEmbeddings(bank, {"items": ["ids"]}))
    history = trainer.fit(data * 3, 3 * STEPS, progress=False, live=False)
    first, last = np.mean([r["loss"] for r in history[:STEPS]]), np.mean([r["loss"] for r in history[-STEPS:]])
    assert last < 0.5 * first, (first, last)
    assert bank.stats()["tables"]["items"]["gradients_received"] == sum(len(np.unique(b["ids"])) for b in data) * 3


def _bank_and_stage(**stage_options):
    bank = KnowledgeBank()
    bank.create_table("items", DIM)
    return bank, BankEmbeddings(bank, {"items": ["ids"]}, **stage_options)


@pytest.mark.parametrize("ids, error, words", [
    (np.array([0.0, 1.0]), TypeError, "dtype float64"),
    (np.array([3, -2], np.int32), ValueError, "negative"),
    (np.array([3, 40], np.int32), ValueError, "out of range"),
])
def test_bad_ids_name_the_field_and_write_nothing(ids, error, words):
    bank, stage = _bank_and_stage(num_ids={"items": NUM_IDS})
    with pytest.raises(error, match=words) as raised:
        stage({"ids": ids, "y": np.zeros(len(ids), np.float32)})
    assert "batch['ids']" in str(raised.value)
    assert bank.stats()["tables"]["items"]["rows"] == 0


def test_a_model_of_another_dim_or_table_is_refused_at_start():
    bank, stage = _bank_and_stage()

    class Wrong(nnx.Module):
        def __init__(self, table, dim):
            self.embed = BankEmbedding(table, dim)

    with pytest.raises(ValueError, match="dim 4; bank table 'items' has dim 8"):
        Trainer(Wrong("items", 4), optax.sgd(0.1), loss_fn, knowledge=stage)
    with pytest.raises(ValueError, match="reads table 'other'"):
        Trainer(Wrong("other", DIM), optax.sgd(0.1), loss_fn, knowledge=stage)
    with pytest.raises(ValueError, match="pass knowledge=BankEmbeddings"):
        Trainer(Wrong("items", DIM), optax.sgd(0.1), loss_fn)
    with pytest.raises(ValueError, match="no table 'nope'"):
        BankEmbeddings(bank, {"nope": ["ids"]})
    assert bank.stats()["tables"]["items"]["rows"] == 0


def test_row_gradients_are_summed_per_distinct_id():
    bank, stage = _bank_and_stage()
    batch = stage({"ids": np.array([5, 5, 7, 5], np.int64), "y": np.zeros(4, np.float32)})
    rows = batch["bank_rows/items"]
    assert rows.shape == (4, DIM) and not rows[2:].any()  # 2 distinct ids padded to min(8, the batch's 4 ids)
    np.testing.assert_array_equal(batch["bank_index/ids"], [0, 0, 1, 0])

    def loss(rows):
        return jnp.sum(jnp.take(rows, jnp.asarray(batch["bank_index/ids"]), axis=0) * jnp.arange(1.0, 5.0)[:, None])

    grads = jax.grad(loss)(jnp.asarray(rows))
    np.testing.assert_allclose(grads[:2, 0], [1 + 2 + 4, 3])
