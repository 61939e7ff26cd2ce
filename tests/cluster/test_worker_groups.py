"""Heterogeneous embedded clusters: named worker groups, each configured from its own facts."""

from __future__ import annotations

import os

import pytest

import carlskit
from carlskit.cluster import WorkerGroup
from carlskit.cluster._environment import WorkerFacts, choose_platform, environment_for

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
