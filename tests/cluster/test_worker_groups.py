"""Heterogeneous embedded clusters: named worker groups, each configured from its own facts."""

from __future__ import annotations

import os
import time

import pytest
from process_helpers import kill_worker, wait_until

import carlskit
from carlskit.cluster import Placement, WorkerGroup, live_workers
from carlskit.cluster._environment import WorkerFacts, choose_platform, environment_for
from carlskit.cluster._supervised import LongRunningTasks, RestartPolicy, stop_flag

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def thread_settings():
    import threadpoolctl

    blas = [pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"]
    return os.environ.get("OMP_NUM_THREADS"), os.environ.get("JAX_PLATFORMS"), blas


def test_two_groups_get_their_own_devices_threads_platforms_and_placement(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the notebook's own setting must not reach the groups
    client = carlskit.connect(worker_groups={
        "accelerator": {"n_workers": 1, "devices": 4, "resources": {"accelerator": 1}},
        "makers": {"n_workers": 1, "threads_per_worker": 2, "resources": {"maker": 1}},
    })
    try:
        report = carlskit.devices(client)
        (accelerator,), (maker,) = report.group("accelerator"), report.group("makers")
        assert accelerator["device_count"] == 4 and maker["device_count"] == 1
        assert accelerator["resources"] == {"accelerator": 1} and maker["resources"] == {"maker": 1}
        assert (accelerator["threads"], maker["threads"]) == (1, 2)
        assert "accelerator" in repr(report) and "makers" in report._repr_html_()
        settings = client.run(thread_settings)
        omp, platform, blas = settings[maker["process"]]
        assert omp == "2" and platform == "cpu", "a CPU-only worker gets JAX_PLATFORMS=cpu and its own threads"
        assert all(threads == 2 for threads in blas)
        omp, platform, _ = settings[accelerator["process"]]
        assert omp == "1" and not platform, "an accelerator worker is left to JAX's best backend"
        placed = {client.submit(os.getpid, pure=False, resources={"maker": 1}).result() for _ in range(4)}
        assert placed == {maker["pid"]}
        assert carlskit.connect() is client, "connect() reuses the running cluster"
        with pytest.raises(ValueError, match="already running"):
            carlskit.connect(worker_groups={"other": {}})
    finally:
        client.close()


def test_platform_is_chosen_from_the_workers_own_facts():
    plain = WorkerFacts(nthreads=1, resources={})
    assert choose_platform(WorkerFacts(1, {}, platform="gpu"), default="cpu") == "gpu", "its own platform wins"
    assert choose_platform(WorkerFacts(1, {"GPU": 1}), default="cpu") is None, "a GPU worker keeps its GPU"
    assert choose_platform(WorkerFacts(1, {"TPU": 4}), default="cpu") is None
    assert choose_platform(plain, default="tpu") == "tpu", "the client's platform is only a default"
    assert environment_for(WorkerFacts(3, {}, host_devices=8), "cpu")["XLA_FLAGS"] == \
        "--xla_force_host_platform_device_count=8"
    assert environment_for(WorkerFacts(3, {}), "cpu")["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("groups, error, match", [
    ({}, ValueError, "non-empty"),
    ({"a": {"n_workers": -1}}, ValueError, r"worker_groups\['a'\].*n_workers"),
    ({"a": {"threads_per_worker": 0}}, ValueError, "threads_per_worker"),
    ({"a": {"platform": "quantum"}}, ValueError, "platform"),
    ({"a": {"resources": {"GPU": 0}}}, ValueError, "resources"),
    ({"a": {"devices": 0}}, ValueError, "devices"),
    ({"a": {"gpus": 1}}, ValueError, r"unknown keys \['gpus'\]"),
    ({"a": 3}, TypeError, r"worker_groups\['a'\] must be a dict"),
    ({1: {}}, TypeError, "group names"),
])
def test_bad_worker_groups_are_named_before_anything_starts(groups, error, match):
    with pytest.raises(error, match=match):
        carlskit.connect(worker_groups=groups)


def test_worker_groups_cannot_be_combined_with_a_remote_or_in_process_cluster():
    with pytest.raises(ValueError, match="worker_groups"):
        carlskit.connect("tcp://127.0.0.1:1", worker_groups={"a": {}})
    with pytest.raises(ValueError, match="worker_groups"):
        carlskit.connect(processes=False, worker_groups={"a": {}})
    assert WorkerGroup(resources={"maker": 1}).resources == {"maker": 1}


def report_pid_until_stopped(path, flag):
    from carlskit.cluster._supervised import secede_if_on_worker

    secede_if_on_worker()
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    while not flag.is_set():
        temporary.write_text(str(os.getpid()))
        os.replace(temporary, path)  # atomic: the test never reads a truncated, empty file
        time.sleep(0.05)


def test_placed_pieces_run_in_their_group_and_a_killed_one_restarts_inside_it(tmp_path):
    client = carlskit.connect(worker_groups={
        "accelerator": {"n_workers": 1, "resources": {"accelerator": 1}},
        "makers": {"n_workers": 1, "resources": {"maker": 1}},
    })
    flag = stop_flag(client, "placement-test")
    tasks = LongRunningTasks(client, "placed", piece="slice", poll_seconds=0.1,
                             policy=RestartPolicy(budget_seconds=120, initial_delay_seconds=0.2, max_delay_seconds=1.0))
    try:
        report = carlskit.devices(client)
        maker_pid = report.group("makers")[0]["pid"]
        accelerator_pid = report.group("accelerator")[0]["pid"]
        placed, default = tmp_path / "placed", tmp_path / "default"
        tasks.launch("placed", report_pid_until_stopped, lambda: (placed, flag),
                     placement=Placement.of(resources={"maker": 1}))
        tasks.launch("default", report_pid_until_stopped, lambda: (default, flag))
        wait_until(lambda: placed.exists() and default.exists(), seconds=60)
        assert int(placed.read_text()) == maker_pid
        assert int(default.read_text()) == maker_pid, "by default nothing lands on an accelerator worker"
        status = tasks.status()
        assert status["placed"]["placement"] == "resources={'maker': 1}"
        assert status["placed"]["worker"] == report.group("makers")[0]["process"]

        kill_worker(client, report.group("makers")[0]["process"])
        killed_at = time.monotonic()
        wait_until(lambda: int(placed.read_text()) not in (maker_pid, accelerator_pid), seconds=120)
        print(f"placed piece back on its group's new worker after {time.monotonic() - killed_at:.1f} s")
        new_maker = carlskit.devices(client).group("makers")[0]
        assert int(placed.read_text()) == new_maker["pid"], "restarted inside its group, never elsewhere"
        assert tasks.status()["placed"]["placement"] == "resources={'maker': 1}"
    finally:
        tasks.stop(flag, timeout=20)
        client.close()


def write_version(context):
    import numpy as np

    rows = np.full((len(context.items), 2), float(context.version), np.float32)
    context.bank.update("emb", context.items, rows, version=context.version)


def test_services_are_placed_by_group_and_a_killed_maker_restarts_inside_its_group(tmp_path):
    import numpy as np

    from carlskit.bank import KnowledgeBank
    from carlskit.makers import Maker
    from carlskit.summaries import SummaryWriter
    from carlskit.training import CheckpointStore

    client = carlskit.connect(worker_groups={
        "accelerator": {"n_workers": 1, "devices": 4, "resources": {"accelerator": 1}},
        "makers": {"n_workers": 1, "resources": {"maker": 1}},
    })
    maker = writer = None
    try:
        report = carlskit.devices(client)
        (accelerator,), (maker_worker,) = report.group("accelerator"), report.group("makers")
        default_bank = KnowledgeBank(client, num_shards=2)
        assert default_bank.shard_workers == [maker_worker["process"]] * 2, "shards stay off the accelerator"
        default_bank.close()
        writer = SummaryWriter(tmp_path / "logs", client=client, n_shards=2)
        assert {agg._address for agg in writer._aggregators} == {maker_worker["process"]}
        writer.scalar("loss", 1.0, 0)
        writer.close()
        # A bank placed explicitly on the accelerator group (by worker name), makers on the makers group.
        bank = KnowledgeBank(client, num_shards=1, workers=["accelerator-0"])
        assert bank.shard_workers == [accelerator["process"]]
        bank.create_table("emb", dim=2, initializer="zeros")
        store = CheckpointStore(tmp_path / "ckpt")
        store.save({"w": np.zeros(1, np.float32)}, version=1)
        items = np.arange(8)
        maker = Maker(write_version, items, num_slices=2, poll_seconds=0.05, resources={"maker": 1},
                      restart_policy=RestartPolicy(budget_seconds=120,
                                                   max_delay_seconds=1.0)).start(store, bank, client)
        maker.wait_for_version(1, timeout=120)
        assert {s["worker"] for s in maker.status()["slices"]} == {maker_worker["process"]}

        kill_worker(client, maker_worker["process"])
        killed_at = time.monotonic()
        def replaced():
            names = {str(info["name"]): address for address, info in live_workers(client).items()}
            return names.get("makers-0") not in (None, maker_worker["process"])

        wait_until(replaced, seconds=120)
        store.save({"w": np.zeros(1, np.float32)}, version=2)
        maker.wait_for_version(2, timeout=120)
        print(f"maker back in its group, writing version 2, {time.monotonic() - killed_at:.1f} s after the kill")
        (new_maker_worker,) = carlskit.devices(client).group("makers")
        assert {s["worker"] for s in maker.status()["slices"]} == {new_maker_worker["process"]}, \
            "restarted inside its group, never on the accelerator"
        assert (bank.row_metadata("emb", items)["version"] == 2).all()
    finally:
        if maker is not None:
            maker.stop()
        client.close()
