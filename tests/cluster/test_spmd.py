"""run_spmd: one JAX program over several Dask workers' processes (gloo collectives on CPU), all
ranks ending together on any failure, relaunched after a lost worker under a restart policy."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time

import psutil
import pytest
import spmd_functions
from process_helpers import checkout_cluster, kill_worker, wait_until

from carlskit import RankFailedError, RankLostError, RestartPolicy
from carlskit.cluster import live_workers, run_spmd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    with checkout_cluster(2) as client:
        yield client


def rank_processes() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "carlskit.cluster._rank" in " ".join(process.info["cmdline"] or ()):
                if process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def port_is_free(port: int) -> bool:
    """Nothing listens on ``port`` and a new server can bind it (SO_REUSEADDR, as gRPC's coordinator
    binds: connections of the ended group may linger in TIME_WAIT)."""
    if any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp")):
        return False
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


class Output:
    """Collects each rank's forwarded lines; knows the group's coordinator port."""

    def __init__(self):
        self.lines: list[tuple[int, str]] = []

    def __call__(self, rank: int, line: str) -> None:
        self.lines.append((rank, line))

    def ports(self) -> set[int]:
        return {int(m.group(1)) for _, line in self.lines for m in [re.search(r"coordinator \S+:(\d+)", line)] if m}


def assert_group_gone(output: Output) -> None:
    wait_until(lambda: not rank_processes(), seconds=10)
    assert output.ports(), "the ranks never said where their coordinator was"
    for port in output.ports():
        assert port_is_free(port), f"the coordinator's port {port} is still bound"


def test_run_spmd_returns_every_ranks_value_in_rank_order_over_one_global_mesh(client):
    output, records = Output(), []
    values = run_spmd(client, spmd_functions.global_sum, 0.5, processes=2, devices_per_process=2, output=output,
                      on_record=records.append, cpus_per_process=1)
    # 2 processes x 2 devices: 4 global devices, and the sum spans both processes
    assert values == [(0, 4, 120.5), (1, 4, 120.5)]
    assert {rank for rank, line in output.lines if line == "sum 120.0"} == {0, 1}  # tagged by rank
    # the workers run with Dask's MALLOC_TRIM_THRESHOLD_=65536 (a JAX step 26% slower); their ranks do not
    assert set(client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values()) == {"65536"}
    assert {line for rank, line in output.lines if "MALLOC" in line} == {"MALLOC_TRIM_THRESHOLD_=None"}
    assert records == [{"step": 1, "rank": 0}, {"step": 2, "rank": 0}]  # rank 0's progress only
    usable = sorted(os.sched_getaffinity(0))  # the workers' (inherited); both ranks share this host
    assert sorted((rank, line) for rank, line in output.lines if line.startswith("cpus ")) == [
        (0, f"cpus [{usable[0]}]"), (1, f"cpus [{usable[1]}]")]  # cpus_per_process=1: one each, disjoint
    assert_group_gone(output)


def test_cpus_per_process_beyond_the_hosts_cpus_is_a_value_error_naming_it(client):
    output = Output()
    too_many = len(os.sched_getaffinity(0))  # rank 0 fits; rank 1, on the same host, does not
    with pytest.raises(ValueError, match=f"cpus_per_process={too_many}: 2 ranks of the group share this host"):
        run_spmd(client, spmd_functions.global_sum, 0.5, processes=2, devices_per_process=1, output=output,
                 cpus_per_process=too_many)
    with pytest.raises(ValueError, match="cpus_per_process"):
        run_spmd(client, spmd_functions.global_sum, 0.5, processes=2, cpus_per_process=0)
    wait_until(lambda: not rank_processes(), seconds=10)  # rank 0 (it fitted) was ended with the group


def test_a_rank_that_raises_ends_every_rank_and_names_itself(client):
    output = Output()
    started = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        run_spmd(client, spmd_functions.rank_one_raises, processes=2, devices_per_process=1, output=output)
    assert caught.value.rank == 1 and caught.value.kind == "raised"
    assert "rank 1 raised ValueError: rank 1's data is bad" in str(caught.value)
    assert "Traceback" in caught.value.logs
    assert isinstance(caught.value.__cause__, ValueError)  # the rank's own exception, when it pickles
    assert_group_gone(output)
    print(f"raised and ended in {time.monotonic() - started:.1f} s")


def test_a_rank_that_exits_without_a_value_ends_the_group(client):
    output = Output()
    with pytest.raises(RankFailedError) as caught:
        run_spmd(client, spmd_functions.rank_one_exits, processes=2, devices_per_process=1, output=output)
    assert caught.value.rank == 1 and caught.value.kind == "exited"
    assert "exited with code 9" in str(caught.value)
    assert_group_gone(output)


def test_a_rank_that_never_reaches_the_collective_is_ended_at_the_timeout(client):
    output = Output()
    started = time.monotonic()
    with pytest.raises(RankFailedError) as caught:
        run_spmd(client, spmd_functions.rank_one_hangs, processes=2, devices_per_process=1, output=output,
                 timeout=20)
    # The kind says the timeout ended it (the rank hangs forever otherwise); no wall-clock bound is asserted on
    # a shared machine (issue 43): the time is printed.
    assert caught.value.kind == "timed out" and "timeout=20 s" in str(caught.value)
    assert_group_gone(output)
    print(f"timed out and ended in {time.monotonic() - started:.1f} s (timeout=20 s)")


def test_a_group_without_progress_for_stall_timeout_is_ended(client):
    output = Output()
    with pytest.raises(RankFailedError) as caught:
        run_spmd(client, spmd_functions.progress_then_rank_one_hangs, processes=2, devices_per_process=1,
                 output=output, stall_timeout=5)
    assert caught.value.kind == "timed out" and "stall_timeout=5 s" in str(caught.value)
    assert_group_gone(output)


def test_an_interrupt_in_the_caller_ends_every_rank(client):
    output = Output()
    # A real SIGINT to this process, as the notebook's stop button sends the kernel, under Python's own
    # handler (a CI run once saw no KeyboardInterrupt at all: the handler in place is printed).
    print(f"SIGINT handler before the test: {signal.getsignal(signal.SIGINT)!r}")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt = threading.Timer(12, os.kill, (os.getpid(), signal.SIGINT))
    interrupt.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_spmd(client, spmd_functions.rank_one_hangs, processes=2, devices_per_process=1, output=output)
    finally:
        interrupt.cancel()
        signal.signal(signal.SIGINT, previous)
    assert_group_gone(output)
    print(f"interrupted and every rank gone {time.monotonic() - started - 12:.1f} s after the interrupt")


def test_a_lost_worker_ends_every_rank_and_a_restart_policy_resumes_the_group(client, tmp_path):
    output = Output()
    addresses = sorted(live_workers(client))

    def kill_rank_one_worker():
        wait_until(lambda: (tmp_path / "step").exists() and int((tmp_path / "step").read_text()) >= 3, seconds=120)
        kill_worker(client, addresses[1])

    threading.Thread(target=kill_rank_one_worker, daemon=True).start()
    with pytest.raises(RankLostError) as caught:
        run_spmd(client, spmd_functions.resumable_steps, str(tmp_path), 40, 0.3, processes=2, devices_per_process=1,
                 output=output)
    assert caught.value.rank == 1 and caught.value.worker == addresses[1]
    assert_group_gone(output)
    stopped_at = int((tmp_path / "step").read_text())
    assert 3 <= stopped_at < 40

    # the same kill under a restart policy: the group comes back on the live workers and finishes
    client.wait_for_workers(2, timeout=120)
    (tmp_path / "step").write_text("0")
    (tmp_path / "launches").unlink()
    addresses[:] = sorted(live_workers(client))
    threading.Thread(target=kill_rank_one_worker, daemon=True).start()
    records = []
    values = run_spmd(client, spmd_functions.resumable_steps, str(tmp_path), 12, 0.3, processes=2,
                      devices_per_process=1, output=output, on_record=records.append,
                      restart_policy=RestartPolicy(budget_seconds=180, initial_delay_seconds=1.0))
    launches = [int(line) for line in (tmp_path / "launches").read_text().split()]
    assert len(launches) == 2 and launches[0] == 0 and launches[1] >= 3  # resumed, not restarted from 0
    assert int((tmp_path / "step").read_text()) == 12
    assert values == [12 - launches[1]] * 2
    assert sorted({r["step"] for r in records}) == list(range(1, 13))
    wait_until(lambda: not rank_processes(), seconds=10)


def test_run_spmd_checks_its_arguments_before_launching_anything(client):
    with pytest.raises(ValueError, match="processes"):
        run_spmd(client, spmd_functions.global_sum, 0.0, processes=0)
    with pytest.raises(TypeError, match="fn must be callable"):
        run_spmd(client, "not a function", processes=2)
    with pytest.raises(ValueError, match="timeout"):
        run_spmd(client, spmd_functions.global_sum, 0.0, processes=2, timeout=-1)
    with pytest.raises(TypeError, match="client"):
        run_spmd(object(), spmd_functions.global_sum, 0.0, processes=2)


def test_a_group_larger_than_the_live_workers_is_refused(client):
    from carlskit.cluster import NoWorkerError

    with pytest.raises(NoWorkerError, match="3 processes"):
        run_spmd(client, spmd_functions.global_sum, 0.0, processes=3)
