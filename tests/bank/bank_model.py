"""A plain-Python model of the KnowledgeBank's documented semantics, and the Hypothesis state
machines that check a real bank against it after every step (tests/bank/test_bank_model.py, and the
long run of ``make soak``).

The model is written from the docstrings (``carlskit.bank._lazy``, ``KnowledgeBank``), key by key
with dicts and lists, not from the implementation's vectorized code:

- a row is inserted (value: the ``zeros`` initializer, version -1, write time = now, 0 lookups) by
  ``lookup(insert_missing=True)``, ``update`` and ``apply_gradients``;
- ``lookup`` applies the key's cached gradients, then counts one lookup per occurrence; ``found`` is
  whether the key existed before the call, absent keys read zeros;
- ``update`` keeps the last value of a repeated key, discards the key's cached gradients, writes
  value, version and write time;
- ``apply_gradients`` caches every gradient with the time; a key holding ``max_pending`` of them is
  flushed at once; a key whose oldest cached gradient is older than ``pending_ttl_seconds`` is
  flushed by the next call that touches the table;
- a flush drops non-finite gradients, then (3 or more left) those whose L2 norm exceeds
  ``median + outlier_threshold * 1.4826 * MAD``, averages the rest and takes one sgd or adagrad step;
- ``nearest`` searches the written values (cached gradients not applied); ``sample`` draws existing
  keys; ``row_metadata`` and ``stats`` count nothing;
- a multi-shard write that raised ShardLostError applied exactly its ``applied_keys``; after
  ``recover()`` with the write-ahead log, the lost shard holds every acknowledged call.

Gradients and values are drawn from small dyadic numbers, so both sides compute the same floats
(compared within 1e-6 anyway).
"""

from __future__ import annotations

import math
import os
import pathlib
import signal
import tempfile
import time
from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from carlskit.bank import KnowledgeBank, ShardLostError

DIM = 2
KEYS = st.integers(1, 10)
NUMBERS = st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 8.0])
GRADIENT_NUMBERS = st.one_of(NUMBERS, st.just(float("nan")))
TABLES = {  # name: options (max_pending, ttl, the optimizer and combine differ)
    "sgd": dict(optimizer="sgd", learning_rate=0.5, max_pending=3, pending_ttl_seconds=10.0,
                outlier_threshold=3.0),
    "adagrad": dict(optimizer="adagrad", learning_rate=0.25, max_pending=4, pending_ttl_seconds=30.0,
                    outlier_threshold=2.0, initial_accumulator_value=0.5, epsilon=1e-6, combine="sum"),
}
MAD_TO_STD = 1.4826


@dataclass
class Row:
    value: np.ndarray
    version: int
    write_time: float
    lookups: int = 0
    accumulator: np.ndarray | None = None
    pending: list = field(default_factory=list)  # [(gradient float32 [DIM], time)]


class TableModel:
    def __init__(self, options: dict) -> None:
        self.options = options
        self.rows: dict[int, Row] = {}

    def _row(self, key: int, now: float) -> Row:
        if key not in self.rows:
            accumulator = (np.full(DIM, self.options["initial_accumulator_value"], np.float32)
                           if self.options["optimizer"] == "adagrad" else None)
            self.rows[key] = Row(np.zeros(DIM, np.float32), -1, now, 0, accumulator)
        return self.rows[key]

    def flush_key(self, key: int, now: float) -> None:
        row = self.rows[key]
        gradients = [g for g, _ in row.pending if np.isfinite(g).all()]
        row.pending = []
        if len(gradients) >= 3:
            norms = [math.sqrt(float(np.dot(g.astype(np.float64), g.astype(np.float64)))) for g in gradients]
            median = float(np.median(norms))
            mad = float(np.median([abs(n - median) for n in norms]))
            limit = median + self.options["outlier_threshold"] * MAD_TO_STD * mad
            gradients = [g for g, n in zip(gradients, norms) if not n > limit]
        if not gradients:
            return
        total = np.sum([g.astype(np.float64) for g in gradients], axis=0)
        divisor = len(gradients) if self.options.get("combine", "mean") == "mean" else 1
        mean = (total / divisor).astype(np.float32)
        rate = np.float32(self.options["learning_rate"])
        if self.options["optimizer"] == "sgd":
            row.value = row.value - rate * mean
        else:
            row.accumulator = row.accumulator + mean * mean
            row.value = row.value - rate * mean / np.sqrt(row.accumulator + np.float32(self.options["epsilon"]))
        row.write_time = now

    def maintain(self, now: float) -> None:
        cutoff = now - self.options["pending_ttl_seconds"]
        for key, row in self.rows.items():
            if row.pending and min(t for _, t in row.pending) < cutoff:
                self.flush_key(key, now)

    def lookup(self, keys: list[int], insert_missing: bool, now: float):
        self.maintain(now)
        found = [key in self.rows for key in keys]
        if insert_missing:
            for key in keys:
                self._row(key, now)
        for key in dict.fromkeys(keys):
            if key in self.rows and self.rows[key].pending:
                self.flush_key(key, now)
        values = np.zeros((len(keys), DIM), np.float32)
        for i, key in enumerate(keys):
            if key in self.rows:
                values[i] = self.rows[key].value
                self.rows[key].lookups += 1
        return values, np.array(found)

    def update(self, keys: list[int], values: np.ndarray, version: int, now: float) -> None:
        self.maintain(now)
        last = {key: i for i, key in enumerate(keys)}
        for key, i in last.items():
            row = self._row(key, now)
            row.pending = []
            row.value = values[i].astype(np.float32)
            row.version = version
            row.write_time = now

    def apply_gradients(self, keys: list[int], gradients: np.ndarray, now: float) -> None:
        self.maintain(now)
        for key, gradient in zip(keys, gradients):
            self._row(key, now).pending.append((gradient.astype(np.float32), now))
        for key in dict.fromkeys(keys):
            if len(self.rows[key].pending) >= self.options["max_pending"]:
                self.flush_key(key, now)

    def flush(self, now: float) -> None:
        for key, row in self.rows.items():
            if row.pending:
                self.flush_key(key, now)

    def scores(self, query: np.ndarray) -> dict[int, float]:
        return {key: float(np.dot(query.astype(np.float32), row.value)) for key, row in self.rows.items()}

    @property
    def pending(self) -> int:
        return sum(len(row.pending) for row in self.rows.values())


class Counts:
    """What the runs did, for the soak's note: steps, kills, recoveries, seconds, failed writes."""

    def __init__(self) -> None:
        self.steps = self.kills = self.recoveries = self.failed_writes = self.examples = 0
        self.workers_added = 0  # a nanny that did not bring its worker back in time: another one started
        self.forced_kills = 0  # of the kills, those forced by force_kill_after_steps
        self.started = time.monotonic()

    def as_dict(self) -> dict:
        return {"steps": self.steps, "examples": self.examples, "kills": self.kills,
                "forced_kills": self.forced_kills, "recoveries": self.recoveries,
                "failed_multi_shard_writes": self.failed_writes,
                "workers_added": self.workers_added,
                "seconds": round(time.monotonic() - self.started, 1), "load_average_1min": os.getloadavg()[0]}


class BankMachine(RuleBasedStateMachine):
    """The rules shared by the embedded and the distributed bank; subclasses make the bank."""

    counts = Counts()
    check_write_times = True

    def table_options(self, name: str) -> dict:
        return TABLES[name]

    def __init__(self) -> None:
        super().__init__()
        self.directory = pathlib.Path(tempfile.mkdtemp(prefix="carlskit-bank-model-"))
        self.bank = self.make_bank()
        self.model: dict[str, TableModel] = {}
        self.snapshots = 0
        type(self).counts.examples += 1

    # -- subclass hooks
    def make_bank(self) -> KnowledgeBank:
        raise NotImplementedError

    def now(self) -> float:
        return 0.0

    def teardown(self) -> None:
        self.bank.close()
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)

    def step(self) -> None:
        type(self).counts.steps += 1

    # -- rules
    @rule(name=st.sampled_from(sorted(TABLES)))
    def create_table(self, name):
        self.step()
        options = self.table_options(name)
        if name in self.model:
            try:
                self.bank.create_table(name, DIM, initializer="zeros", **options)
            except ValueError as error:
                assert "already exists" in str(error)
            else:
                raise AssertionError(f"create_table({name!r}) twice was accepted")
            return
        self.bank.create_table(name, DIM, initializer="zeros", **options)
        self.model[name] = TableModel(options)

    def tables(self):
        return st.sampled_from(sorted(TABLES))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), keys=st.lists(KEYS, min_size=1, max_size=6), insert_missing=st.booleans())
    def lookup(self, data, keys, insert_missing):
        self.step()
        table = data.draw(st.sampled_from(sorted(self.model)), "table")
        values, found = self.bank.lookup(table, np.array(keys, np.int64), insert_missing=insert_missing)
        expected_values, expected_found = self.model[table].lookup(keys, insert_missing, self.now())
        np.testing.assert_array_equal(found, expected_found)
        np.testing.assert_allclose(values, expected_values, rtol=1e-6, atol=1e-6)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), keys=st.lists(KEYS, min_size=1, max_size=6), version=st.integers(0, 5))
    def update(self, data, keys, version):
        self.step()
        table = data.draw(st.sampled_from(sorted(self.model)), "table")
        values = np.array(data.draw(st.lists(st.lists(NUMBERS, min_size=DIM, max_size=DIM),
                                             min_size=len(keys), max_size=len(keys)), "values"), np.float32)
        self.write("update", table, keys, values, version)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), keys=st.lists(KEYS, min_size=1, max_size=6))
    def apply_gradients(self, data, keys):
        self.step()
        table = data.draw(st.sampled_from(sorted(self.model)), "table")
        gradients = np.array(data.draw(st.lists(st.lists(GRADIENT_NUMBERS, min_size=DIM, max_size=DIM),
                                                min_size=len(keys), max_size=len(keys)), "gradients"), np.float32)
        self.write("apply_gradients", table, keys, gradients)

    def write(self, method, table, keys, arrays, *extra):
        """The call on the bank and, as acknowledged, on the model."""
        getattr(self.bank, method)(table, np.array(keys, np.int64), arrays, *extra)
        getattr(self.model[table], method)(keys, arrays, *extra, self.now())

    @precondition(lambda self: self.model)
    @rule(data=st.data(), every_table=st.booleans())
    def flush(self, data, every_table):
        self.step()
        table = None if every_table else data.draw(st.sampled_from(sorted(self.model)), "table")
        self.bank.flush(table)
        for name, model in self.model.items():
            if table is None or name == table:
                model.maintain(self.now())
                model.flush(self.now())
            else:
                pass

    @precondition(lambda self: self.model)
    @rule(data=st.data(), query=st.lists(NUMBERS, min_size=DIM, max_size=DIM), k=st.integers(1, 4))
    def nearest(self, data, query, k):
        self.step()
        table = data.draw(st.sampled_from(sorted(self.model)), "table")
        keys, scores = self.bank.nearest(table, np.array([query], np.float32), k=k, metric="dot", exact=True)
        model = self.model[table]
        model.maintain(self.now())
        expected = model.scores(np.array(query, np.float32))
        best = sorted(expected.values(), reverse=True)[:k]
        got = [float(s) for key, s in zip(keys[0], scores[0]) if key >= 0]
        assert len(got) == len(best), (keys, expected)
        np.testing.assert_allclose(got, best, rtol=1e-6, atol=1e-6)
        for key, score in zip(keys[0], scores[0]):
            if key >= 0:
                assert abs(expected[int(key)] - float(score)) <= 1e-6 * (1 + abs(score)), (key, score)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 5), seed=st.integers(0, 3))
    def sample(self, data, n, seed):
        self.step()
        table = data.draw(st.sampled_from(sorted(self.model)), "table")
        model = self.model[table]
        model.maintain(self.now())
        if not model.rows:
            try:
                self.bank.sample(table, n, seed)
            except ValueError as error:
                assert "empty" in str(error)
            else:
                raise AssertionError("sample from an empty table was accepted")
            return
        drawn = self.bank.sample(table, n, seed)
        assert len(drawn) == n and set(drawn.tolist()) <= set(model.rows), (drawn, sorted(model.rows))

    @precondition(lambda self: self.model)
    @rule()
    def snapshot(self):
        """A snapshot changes nothing; loaded into a new bank, it holds the model's state."""
        self.step()
        path = self.bank.snapshot()
        self.snapshots += 1
        if self.snapshots % 3 == 1:  # loading is slower: check one snapshot in three
            copy = KnowledgeBank.load(path, **self.load_arguments())
            try:
                for table, model in self.model.items():
                    self.compare_metadata(copy, table, model, write_times=False)
            finally:
                copy.close()

    def load_arguments(self) -> dict:
        return {}

    # -- the check after every step
    @invariant()
    def matches_the_model(self):
        for table, model in self.model.items():
            model.maintain(self.now())
            self.compare_metadata(self.bank, table, model, write_times=self.check_write_times)

    def compare_metadata(self, bank, table, model, write_times):
        keys = np.arange(1, 11, dtype=np.int64)
        meta = bank.row_metadata(table, keys)
        rows = [model.rows.get(int(key)) for key in keys]
        np.testing.assert_array_equal(meta["found"], [row is not None for row in rows])
        np.testing.assert_array_equal(meta["version"], [-1 if row is None else row.version for row in rows])
        np.testing.assert_array_equal(meta["lookup_count"], [0 if row is None else row.lookups for row in rows])
        if write_times:
            np.testing.assert_array_equal(meta["last_write_time"],
                                          [np.nan if row is None else row.write_time for row in rows])
        stats = bank.stats()["tables"][table]
        assert stats["rows"] == len(model.rows) and stats["pending_gradients"] == model.pending, (
            stats["rows"], len(model.rows), stats["pending_gradients"], model.pending)


class SettableClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class EmbeddedBankMachine(BankMachine):
    """Two in-process shards with a settable clock: write times and ttl flushes are exact."""

    counts = Counts()

    def make_bank(self) -> KnowledgeBank:
        self.clock = SettableClock()
        bank = KnowledgeBank(num_shards=2, clock=self.clock)
        bank.enable_snapshots(self.directory / "snapshots", keep=2)
        return bank

    def now(self) -> float:
        return self.clock.now

    def load_arguments(self) -> dict:
        return {"clock": self.clock}

    @rule(seconds=st.sampled_from([0.5, 4.0, 12.0, 40.0]))
    def advance_clock(self, seconds):
        self.step()
        self.clock.now += seconds


class DistributedBankMachine(BankMachine):
    """Two shards on the two workers of ``client`` (set by the test), snapshots + write-ahead log;
    a rule SIGKILLs a random shard's worker, tries a write while the shard is lost (what it applied
    goes into the model), then ``recover()``s: the model must still hold."""

    counts = Counts()
    client = None
    check_write_times = False  # the shards' clocks are the workers' real clocks
    steps_between_kills = 10
    # A kill forced by the step after this many steps without one, whatever Hypothesis draws (0: never).
    # Issue 43: a derandomized run drew 0 kills after an unrelated edit of this class; a forced kill
    # makes the kills (and the half-applied write it tries while the shard is lost) certain.
    force_kill_after_steps = 0
    durability = "process"  # of the write-ahead log

    def table_options(self, name: str) -> dict:
        # Real clocks: a ttl flush would depend on how long a kill took (the first soak found
        # exactly that divergence in the model, whose clock stood still): no ttl here; the
        # embedded machine checks ttl flushes with its settable clock.
        return {**TABLES[name], "pending_ttl_seconds": 1e9}

    def two_live_workers(self) -> None:
        """Wait for two running workers. On the loaded 2-core machine a nanny once did not bring its
        SIGKILLed worker back within 120 s (Dask, not the bank): then one more worker is started."""
        try:
            self.client.wait_for_workers(2, timeout=90)
        except TimeoutError:
            type(self).counts.workers_added += 1
            self.client.cluster.scale(len(self.client.scheduler_info()["workers"]) + 1)
            self.client.wait_for_workers(2, timeout=300)

    def make_bank(self) -> KnowledgeBank:
        self.two_live_workers()
        bank = KnowledgeBank(self.client, num_shards=2)
        bank.enable_snapshots(self.directory / "snapshots", keep=2, write_ahead_log=True,
                              durability=self.durability)
        self.since_kill = 0  # per example: a precondition must not depend on earlier examples
        return bank

    def step(self) -> None:
        super().step()
        self.since_kill += 1
        if self.force_kill_after_steps and self.model and self.since_kill > self.force_kill_after_steps:
            # keys 1-10 span both shards, so the write while one is lost is half-applied
            type(self).counts.forced_kills += 1
            self.kill_then_recover(type(self).counts.kills % 2, list(range(1, 11)), 0.5)

    def teardown(self) -> None:
        try:
            self.bank.recover()  # a shard lost by a failed step: release cleanly
        except (ValueError, ShardLostError):
            pass
        super().teardown()

    @precondition(lambda self: self.model and self.since_kill >= self.steps_between_kills)
    @rule(shard=st.integers(0, 1), data=st.data())
    def kill_a_shard_worker_then_recover(self, shard, data):
        self.since_kill = 0  # this step is the kill: no forced one before it
        self.step()
        keys = data.draw(st.lists(KEYS, min_size=1, max_size=6), "keys while lost")
        self.kill_then_recover(shard, keys, float(data.draw(NUMBERS, "value while lost")))

    def kill_then_recover(self, shard: int, keys: list[int], value: float) -> None:
        """SIGKILL the worker of ``shard``, write ``keys`` while it is lost, then ``recover()``."""
        self.since_kill = 0
        counts = type(self).counts
        self.two_live_workers()
        worker = self.bank.shard_workers[shard]
        os.kill(self.client.run(os.getpid, workers=[worker])[worker], signal.SIGKILL)
        counts.kills += 1
        table = sorted(self.model)[0]
        deadline = time.monotonic() + 60
        while True:  # until a call notices (row_metadata changes nothing)
            try:
                self.bank.row_metadata(table, np.arange(1, 11))
            except ShardLostError:
                break
            assert time.monotonic() < deadline, "the kill was never noticed"
            time.sleep(0.05)
        # a write while the shard is lost: the model takes exactly what it says it applied
        values = np.full((len(keys), DIM), value, np.float32)
        try:
            self.bank.update(table, np.array(keys, np.int64), values, 7)
            applied = keys
        except ShardLostError as error:
            counts.failed_writes += 1
            applied_keys = set(error.applied_keys.tolist())
            applied = [key for key in keys if key in applied_keys]
        if applied:
            positions = [i for i, key in enumerate(keys) if key in set(applied)]
            self.model[table].update([keys[i] for i in positions], values[positions], 7, self.now())
        report = self.bank.recover()
        assert report, "no shard was lost"
        counts.recoveries += len(report)
        # A worker SIGKILLed while its nanny is still starting it is never restarted (Dask): let
        # the restarted worker finish starting before any later kill.
        self.two_live_workers()
        time.sleep(2.0)
