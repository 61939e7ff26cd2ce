"""connect(): embedded LocalCluster, existing clients, real remote schedulers, TLS, timeouts."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import distributed
import pytest
from distributed import Security

import carlskit
from carlskit.cluster import live_workers
from carlskit.cluster._environment import machine_has_accelerator

# Workers started by the `dask` CLI cannot import this test module: ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def worker_settings():
    return (
        os.environ.get("OMP_NUM_THREADS"),
        os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
        os.environ.get("JAX_PLATFORMS"),
    )


def test_embedded_cluster_is_started_once_and_configures_workers():
    client = carlskit.connect(n_workers=2, threads_per_worker=1, platform="cpu")
    try:
        assert len(live_workers(client)) == 2
        assert client.dashboard_link.startswith("http://127.0.0.1:")
        assert carlskit.connect() is client, "a second connect() must reuse the running client"
        settings = client.run(worker_settings)
        assert set(settings.values()) == {("1", "false", "cpu")}
        report = carlskit.devices(client)
        assert len(report.workers) == 2
        assert {row["backend"] for row in report} == {"cpu"}
        assert report["client"]["device_count"] >= 1
        assert "<table>" in report._repr_html_() and "device_kinds" in repr(report)
    finally:
        client.close()
    assert distributed.client._get_global_client() is None


def test_in_process_cluster_leaves_the_notebook_environment_alone(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    client = carlskit.connect(n_workers=1, processes=False, platform="cpu")
    try:
        assert "JAX_PLATFORMS" not in os.environ
        assert client.submit(sum, [1, 2, 3]).result() == 6
        assert client.scheduler.address.startswith("inproc://")
    finally:
        client.close()


def test_scheduler_address_from_environment(monkeypatch):
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
    ) as cluster:
        monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", cluster.scheduler_address)
        client = carlskit.connect(timeout=10)
        try:
            assert client.scheduler.address == cluster.scheduler_address
            assert client.submit(sum, [1, 2, 3]).result() == 6
        finally:
            client.close()


def _dask_cli() -> str:
    path = Path(sys.executable).with_name("dask")
    return str(path) if path.exists() else shutil.which("dask")


def _wait_for_file(path: Path, process: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if process.poll() is not None:
            raise RuntimeError(f"dask scheduler exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("dask scheduler did not write its scheduler file")
        time.sleep(0.1)


@pytest.fixture
def cli_cluster(tmp_path):
    """A scheduler and a worker started as separate processes with the `dask` command line."""
    scheduler_file = tmp_path / "scheduler.json"
    scheduler = subprocess.Popen(
        [_dask_cli(), "scheduler", "--host", "127.0.0.1", "--port", "0",
         "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(scheduler_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    worker = None
    try:
        _wait_for_file(scheduler_file, scheduler)
        worker = subprocess.Popen(
            [_dask_cli(), "worker", "--scheduler-file", str(scheduler_file), "--nworkers", "1",
             "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        yield scheduler_file
    finally:
        for process in (worker, scheduler):
            if process is not None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def test_connects_to_cli_started_scheduler_and_worker(cli_cluster):
    client = carlskit.connect(scheduler_file=cli_cluster, threads_per_worker=1, timeout=30)
    try:
        client.wait_for_workers(1, timeout=60)
        assert client.submit(lambda x: x + 1, 41).result() == 42
        # The plugin configured the worker the CLI started (not spawned by carlskit), from its own
        # facts: one thread, no accelerator resource, so CPU on a machine without an accelerator.
        expected_platform = None if machine_has_accelerator() else "cpu"
        assert set(client.run(worker_settings).values()) == {("1", "false", expected_platform)}
        # ...and did so before JAX was imported there (shipping the plugin does not import JAX).
        preconfigured = client.run(lambda dask_worker: dask_worker.carlskit_jax_preconfigured)
        assert set(preconfigured.values()) == {True}
        address = client.scheduler.address
    finally:
        client.close()
    by_address = carlskit.connect(address, timeout=30)
    try:
        assert by_address.submit(pow, 2, 10).result() == 1024
    finally:
        by_address.close()


def test_tls_cluster_refuses_a_client_without_credentials():
    security = Security.temporary()
    client = carlskit.connect(n_workers=1, security=security)
    try:
        address = client.scheduler.address
        assert address.startswith("tls://")
        assert client.submit(lambda: "over tls").result() == "over tls"
        # the bank's direct data path is plain tcp: on a TLS cluster it stays on Dask's comm
        bank = carlskit.KnowledgeBank(client, num_shards=1)
        bank.create_table("emb", dim=4, initializer="zeros")
        assert bank.transport == "dask"
        assert bank.lookup("emb", [1, 2], insert_missing=True)[1].tolist() == [False, False]
        bank.close()
        plaintext = address.replace("tls://", "tcp://")
        with pytest.raises(ConnectionError, match="tcp://"):
            carlskit.connect(plaintext, timeout=3)
        with pytest.raises(ConnectionError, match="tls://"):
            carlskit.connect(address, security=Security.temporary(), timeout=3)  # other CA
        with pytest.raises(ValueError, match="security"):
            carlskit.connect(address, timeout=3)
    finally:
        client.close()


@pytest.mark.timeout(30)
def test_unreachable_address_is_a_clear_error_not_a_hang():
    with pytest.raises(ConnectionError, match="tcp://127.0.0.1:9.*within 2 s"):
        carlskit.connect("tcp://127.0.0.1:9", timeout=2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("greeting", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_a_server_that_is_not_dask_is_a_clear_error_not_a_hang(greeting):
    """The dashboard's HTTP port (sends nothing until asked) or any server that greets in another
    protocol: plain distributed.Client waits forever or reads a frame of exabytes."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def answer():
            connection, _ = server.accept()
            if greeting is not None:
                connection.sendall(greeting)
            time.sleep(5)
            connection.close()

        threading.Thread(target=answer, daemon=True).start()
        expected = "sent no Dask handshake within 2 s" if greeting is None else "does not speak Dask"
        with pytest.raises(ConnectionError, match=expected):
            carlskit.connect(f"tcp://127.0.0.1:{port}", timeout=2)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="address or scheduler_file"):
        carlskit.connect("tcp://127.0.0.1:9", scheduler_file="x.json")
    with pytest.raises(TypeError, match="address"):
        carlskit.connect(8786)
    with pytest.raises(ValueError, match="timeout"):
        carlskit.connect("tcp://127.0.0.1:9", timeout=0)
    with pytest.raises(FileNotFoundError, match="scheduler_file"):
        carlskit.connect(scheduler_file="/nonexistent/scheduler.json")
    with pytest.raises(ValueError, match="n_workers"):
        carlskit.connect(n_workers=-1)
    with pytest.raises(ValueError, match="timeout"):  # a string, but not a duration
        carlskit.connect("tcp://127.0.0.1:9", timeout="soon")
    with pytest.raises(TypeError, match="timeout"):
        carlskit.connect("tcp://127.0.0.1:9", timeout=True)
    with pytest.raises(ValueError, match="threads_per_worker"):
        carlskit.connect(threads_per_worker=0)


def run_program(script: Path) -> subprocess.CompletedProcess:
    """Run ``script`` as a program with this checkout importable; its captured output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)


CLOSE_WHILE_HEARTBEATING = r'''
import sys, time
import carlskit

def heartbeat_nonstop(dask_worker):
    async def beat():
        while dask_worker.status.name in ("running", "paused"):
            await dask_worker.heartbeat()
    dask_worker.loop.add_callback(beat)

if __name__ == "__main__":
    for _ in range(3):
        client = carlskit.connect(n_workers=2)
        client.run(heartbeat_nonstop)
        time.sleep(0.3)
        client.close()
    print("closed three times")
'''


def test_closing_an_embedded_cluster_while_workers_heartbeat_prints_no_error(tmp_path):
    # Before issue 44 a heartbeat in flight at close logged a 25-line "distributed.worker - ERROR ...
    # CommClosedError" block: 2 closes in 3 with workers heart-beating nonstop (as here), 1 in 6 as run.
    script = tmp_path / "close_while_heartbeating.py"
    script.write_text(CLOSE_WHILE_HEARTBEATING)
    run = run_program(script)
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "closed three times" in run.stdout, output[-3000:]
    assert "ERROR" not in output and "Traceback" not in output, output[-3000:]


PROGRAM_IMPORTING_JAX = r'''
import jax  # at the top of the program, as in python -m carlskit.paradigms.graph_reg
import carlskit

if __name__ == "__main__":
    client = carlskit.connect(n_workers=1)
    configured = client.run(lambda dask_worker: dask_worker.carlskit_jax_preconfigured)
    print("configured before JAX:", all(configured.values()))
    client.close()
'''


def test_a_program_that_imports_jax_gets_workers_configured_before_jax(tmp_path):
    # multiprocessing's spawn re-imported the program's __main__ in every worker, JAX with it, before
    # carlskit's plugin ran: the CLI warned "JAX was imported on worker ..." about its own cluster (issue 44).
    script = tmp_path / "program_importing_jax.py"
    script.write_text(PROGRAM_IMPORTING_JAX)
    run = run_program(script)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "configured before JAX: True" in run.stdout, run.stdout + run.stderr[-3000:]
    assert "before carlskit configured it" not in run.stderr, run.stderr[-3000:]


SLOW_TO_EXIT = r'''
import atexit, time
import carlskit

def exit_slowly():
    atexit.register(time.sleep, 6)  # longer than the 4 s Dask's own close waits before it kills

if __name__ == "__main__":
    client = carlskit.connect(n_workers=1)
    client.run(exit_slowly)
    client.close()
    print("closed")
'''


def test_a_worker_slow_to_exit_is_waited_for_not_killed_with_a_warning(tmp_path):
    # Notebook 09's final client.close() printed "distributed.nanny - WARNING - Worker process still alive
    # after 4.0 seconds, killing" on its stderr at load 6-14 (issue 44): workers now get WORKER_EXIT_SECONDS.
    script = tmp_path / "slow_to_exit.py"
    script.write_text(SLOW_TO_EXIT)
    run = run_program(script)
    assert run.returncode == 0 and "closed" in run.stdout, run.stderr[-3000:]
    assert "still alive" not in run.stderr and "WARNING" not in run.stderr, run.stderr[-3000:]
