"""Makers: refresh knowledge from the latest checkpoint, report lag, restart after errors.

A maker whose worker is SIGKILLed: tests/chaos/test_makers_chaos.py.
"""

import time

import numpy as np
import pytest
from process_helpers import wait_until

from carlskit.bank import KnowledgeBank
from carlskit.makers import Maker
from carlskit.training import CheckpointStore


def write_version(context):
    """Knowledge = the checkpoint's scalar 'w' broadcast, written with the checkpoint's version."""
    value = float(context.checkpoint["['w']"])
    rows = np.full((len(context.items), 4), value, np.float32)
    context.bank.update("emb", context.items, rows, version=context.version)


def fails_first_round():
    """A maker function whose first round raises ZeroDivisionError; later rounds write_version."""
    calls = []

    def flaky(context):
        calls.append(context.version)
        if len(calls) == 1:
            raise ZeroDivisionError("first round fails")
        write_version(context)

    return flaky


def bank_versions(bank, items):
    return bank.row_metadata("emb", items)["version"]


def test_embedded_maker_follows_checkpoints_and_reports_lag(tmp_path):
    bank = KnowledgeBank()
    bank.create_table("emb", dim=4, initializer="zeros")
    store = CheckpointStore(tmp_path, keep=None)
    items = np.arange(100)
    maker = Maker(write_version, items, num_slices=3, poll_seconds=0.01).start(store, bank)
    try:
        for version in (1, 2, 3):
            store.save({"w": np.float32(version * 10)}, version=version)
            wait_until(lambda: (bank_versions(bank, items) == version).all())
        values, found = bank.lookup("emb", items)
        assert found.all() and (values == 30.0).all()
        status = maker.status()
        assert [s["lag"] for s in status["slices"]] == [0, 0, 0]
        assert all(s["items_per_s"] > 0 for s in status["slices"])
        assert status["errors"] == [] and status["restarts"] == 0
    finally:
        maker.stop()


def test_a_failing_maker_is_restarted_and_its_error_kept(tmp_path, capsys):
    bank = KnowledgeBank()
    bank.create_table("emb", dim=4, initializer="zeros")
    store = CheckpointStore(tmp_path)
    flaky = fails_first_round()

    store.save({"w": np.float32(1)}, version=1)
    maker = Maker(flaky, np.arange(10), poll_seconds=0.01).start(store, bank)
    try:
        wait_until(lambda: (bank_versions(bank, np.arange(10)) == 1).all())
    finally:
        maker.stop()
    status = maker.status()
    assert status["restarts"] == 1 and "ZeroDivisionError: first round fails" in status["errors"][0]
    assert "first round fails" in capsys.readouterr().err


def test_bad_maker_arguments():
    with pytest.raises(TypeError, match="fn"):
        Maker("not callable", np.arange(3))
    with pytest.raises(ValueError, match="items"):
        Maker(write_version, np.array([0.5, 1.5]))
    with pytest.raises(ValueError, match="num_slices"):
        Maker(write_version, np.arange(3), num_slices=4)


def test_a_round_whose_inputs_are_missing_is_retried_not_counted(tmp_path):
    bank = KnowledgeBank()
    bank.create_table("emb", dim=4, initializer="zeros")
    store = CheckpointStore(tmp_path)
    ready = []

    def needs_input(context):
        if not ready:
            return False
        write_version(context)

    store.save({"w": np.float32(2)}, version=1)
    maker = Maker(needs_input, np.arange(8), poll_seconds=0.01).start(store, bank)
    try:
        time.sleep(0.3)
        assert maker.status()["slices"][0]["version"] is None, "not ready: no round counted"
        ready.append(True)
        maker.wait_for_version(1, timeout=30)
        assert (bank_versions(bank, np.arange(8)) == 1).all()
    finally:
        maker.stop()


def test_paradigms_keep_a_run_whose_maker_recovered_and_refuse_one_whose_maker_gave_up(tmp_path):
    # makers_running (every paradigm's maker harness): a slice that raised once and was restarted
    # cost one round of stale knowledge, so the run stands with a warning (it used to raise, which
    # failed a whole GAM notebook on one transient error); a slice that spent its budget raises.
    from carlskit import ServiceGaveUpError
    from carlskit.cluster import RestartPolicy
    from carlskit.paradigms._cli import makers_running

    bank = KnowledgeBank()
    bank.create_table("emb", dim=4, initializer="zeros")
    store = CheckpointStore(tmp_path)
    store.save({"w": np.float32(0)}, version=0)
    flaky = fails_first_round()

    with pytest.warns(RuntimeWarning, match=r"1 maker error\(s\), each recovered.*first round fails"):
        with makers_running([(Maker(flaky, np.arange(10), poll_seconds=0.01, name="flaky"), store)], bank):
            pass
    assert (bank_versions(bank, np.arange(10)) == 0).all()

    def broken(context):
        raise ZeroDivisionError("every round fails")

    policy = RestartPolicy(budget_seconds=0.3, initial_delay_seconds=0.01, max_delay_seconds=0.05)
    maker = Maker(broken, np.arange(10), poll_seconds=0.01, name="broken", restart_policy=policy)
    with pytest.raises(ServiceGaveUpError, match="broken"):
        with makers_running([(maker, store)], bank):
            pass
