"""Chaos: a Trainer training a bank embedding table (``BankEmbeddings``) while the worker of one of
the table's two shards is SIGKILLed. With snapshots and the write-ahead log on, ``fit`` recovers the
shard (``bank.recover()``), re-sends the gradients the lost shard never acknowledged, and every
step's gradient is in the table at the end: the rows equal the sum of all gradients, computed here."""

from __future__ import annotations

import os
import signal
import threading
import time

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from process_helpers import checkout_cluster

from carlskit.bank import KnowledgeBank
from carlskit.training import BankEmbedding, BankEmbeddings, Trainer

DIM, LR, STEPS, KILL_AT = 4, 0.1, 40, 15
KEYS = np.arange(1, 201, dtype=np.int64)


@pytest.fixture(scope="module")
def client():
    with checkout_cluster(2) as dask_client:
        yield dask_client


class Rows(nnx.Module):
    def __init__(self):
        self.embed = BankEmbedding("emb", DIM)


def weighted_sum(model, batch):
    """The gradient of a row is the sum of ``c`` over its uses: known whatever the row holds."""
    return jnp.sum(model.embed(batch, "ids") * batch["c"]), {}


def batch_at(step):
    rng = np.random.default_rng(step)
    return {"ids": rng.choice(KEYS, 32), "c": rng.normal(size=(32, DIM)).astype(np.float32)}


def table_bank(client, tmp_path) -> KnowledgeBank:
    """A 2-shard bank (one shard per worker) with table "emb", snapshots and the write-ahead log."""
    client.wait_for_workers(2, timeout=120)
    bank = KnowledgeBank(client, num_shards=2)
    assert len(set(bank.shard_workers)) == 2
    bank.create_table("emb", DIM, initializer="zeros", learning_rate=LR, max_pending=1)
    bank.enable_snapshots(tmp_path / "bank", write_ahead_log=True)
    return bank


def assert_every_gradient_counted_once(bank: KnowledgeBank) -> None:
    """The rows equal the sum of every step's gradient, computed here."""
    expected = np.zeros((KEYS.max() + 1, DIM))
    for step in range(STEPS):
        batch = batch_at(step)
        np.add.at(expected, batch["ids"], -LR * batch["c"])
    values, _ = bank.lookup("emb", KEYS)
    np.testing.assert_allclose(values, expected[KEYS], atol=1e-4)


def test_no_acknowledged_gradient_is_lost_when_a_table_shard_dies(client, tmp_path, record_property):
    bank = table_bank(client, tmp_path)
    stage = BankEmbeddings(bank, {"emb": ["ids"]})
    trainer = Trainer(Rows(), optax.sgd(0.0), weighted_sum, knowledge=stage, prefetch=1)
    killed = threading.Event()

    def data(step):
        if step == KILL_AT and not killed.is_set():
            worker = bank.shard_workers[1]
            os.kill(client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
            killed.set()
            time.sleep(1.0)  # the bank's next call meets the dead worker
        return batch_at(step)

    history = trainer.fit(data, STEPS, progress=False, live=False)
    assert len(history) == STEPS and trainer.step == STEPS
    # shard 1 rebuilt once; a push sent to it before the rebuild may report the loss afterwards, and
    # its recover() then finds nothing to rebuild (its gradients are re-sent all the same)
    recovered = [r["shards"] for r in trainer.bank_recoveries]
    assert recovered[0] == [1] and all(shards == [] for shards in recovered[1:]), recovered
    assert_every_gradient_counted_once(bank)
    record_property("recovery_seconds", trainer.bank_recoveries[0]["seconds"])
    record_property("resent_gradients", stage.resent_gradients)
    print(f"\nrecoveries {recovered}: shard 1 in {trainer.bank_recoveries[0]['seconds']:.2f} s, "
          f"re-sent {stage.resent_gradients} gradients, "
          f"{bank.stats()['tables']['emb']['repeated_pushes_skipped']} pushes skipped as repeated")
    bank.close()


def test_a_push_logged_but_never_acknowledged_counts_once_after_its_re_send(client, tmp_path):
    """The worker of shard 1 dies right after it logged and applied a push, before it answered:
    the trainer sees the push lost and re-sends it after recover(), whose log replay applied it
    already. Sent with its id, the re-send is skipped; without ids (before the fix) the push counted
    twice and the rows differed from the sum (a CI run saw 68 of 800 values off by up to 0.19)."""
    bank = table_bank(client, tmp_path)

    def die_after_applying(shard_index=1, at_call=12):
        import os as worker_os
        import signal as worker_signal

        from carlskit.bank import _shard

        real, calls = _shard._Shard.apply_gradients, [0]

        def apply_then_die(self, *args, **kwargs):
            real(self, *args, **kwargs)  # logged (write-ahead) and applied
            if self.shard_index == shard_index:
                calls[0] += 1
                if calls[0] == at_call:  # never acknowledged
                    worker_os.kill(worker_os.getpid(), worker_signal.SIGKILL)

        _shard._Shard.apply_gradients = apply_then_die

    client.run(die_after_applying, workers=[bank.shard_workers[1]])  # the restarted worker is plain
    stage = BankEmbeddings(bank, {"emb": ["ids"]})
    trainer = Trainer(Rows(), optax.sgd(0.0), weighted_sum, knowledge=stage, prefetch=1)
    trainer.fit(batch_at, STEPS, progress=False, live=False)
    assert trainer.step == STEPS and trainer.bank_recoveries[0]["shards"] == [1]
    skipped = bank.stats()["tables"]["emb"]["repeated_pushes_skipped"]
    print(f"\nre-sent {stage.resent_gradients} gradients, {skipped} pushes skipped as repeated")
    assert stage.resent_gradients > 0 and skipped >= 1
    assert_every_gradient_counted_once(bank)
    bank.close()
