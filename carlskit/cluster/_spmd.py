"""One JAX program over several Dask workers: :func:`run_spmd` (GShard's and CARLS' trainers span
many hosts; ``jax.distributed`` makes their devices one mesh).

A group of ``processes`` ranks is launched from the notebook on live workers of a
:class:`~carlskit.cluster.Placement` (sorted addresses give the ranks, so the same workers give the
same ranks). Each rank is a *fresh* process (``python -m carlskit.cluster._rank``) started by a task
pinned to its worker, never the worker itself, which may have used JAX already. Rank 0's task first
picks a free port on its host for the coordinator; every rank then calls
``jax.distributed.initialize(coordinator, processes, rank)`` with gloo collectives on CPU
(``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``; the accelerator's own runtime on GPU/TPU) and runs
``fn(*args)``. Their values come back as a list in rank order.

All or nothing. Every rank's task watches a stop event of the group; the caller watches the tasks
and the workers. The first of these ends the group:

- a rank raises (:class:`carlskit.RankFailedError`, ``kind="raised"``, its traceback attached) or
  exits without a value (``kind="exited"``);
- a rank's worker leaves the scheduler (:class:`carlskit.RankLostError`, a worker loss: with a
  ``restart_policy`` the group is launched again on live workers, and ``fn`` resumes from its own
  checkpoints, as ``Trainer.fit(processes=N)`` does);
- ``timeout`` seconds pass (``kind="timed out"``), or ``stall_timeout`` seconds without a progress
  record from any rank once one was sent: a rank stuck before a collective holds its peers in it;
- the caller is interrupted (``KeyboardInterrupt`` in a notebook).

Then every rank's process is sent SIGTERM and, :data:`KILL_GRACE_SECONDS` later, SIGKILL (its
process group: nothing it started survives), which frees the coordinator's port. A rank whose
worker is SIGKILLed dies with it (parent-death signal and a watcher thread). Inside JAX,
``initialization_timeout`` bounds the wait for all ranks to join and ``heartbeat_timeout`` the
time a dead peer goes unnoticed by the runtime itself (JAX's defaults are 300 s and 100 s; ours
60 s and 30 s, since the caller's own watch above is faster still).

Each rank's output (stdout and stderr, merged) reaches the caller line by line, tagged
``[rank r]``, and the last lines of a failed rank are in the error. ``report_progress(record)``
inside ``fn`` sends a record to the caller's ``on_record`` (rank 0's only: it drives the notebook's
progress bar, live plot and summaries).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from carlskit._checks import positive_float, positive_int
from carlskit._errors import RankFailedError, RankLostError
from carlskit.cluster._placement import NoWorkerError, Placement, is_accelerator, live_workers
from carlskit.cluster._service import retry_on_worker_loss
from carlskit.cluster._supervised import secede_if_on_worker

#: Seconds between SIGTERM and SIGKILL when a group is ended.
KILL_GRACE_SECONDS = 2.0
#: How often a rank's task forwards output and checks the stop event, and the caller checks the tasks.
POLL_SECONDS = 0.2
#: How often the caller asks the scheduler which workers are alive.
LIVENESS_SECONDS = 1.0
#: Lines of each rank's output kept for the error message.
TAIL_LINES = 40
#: Runtime chatter dropped from the forwarded output (kept in the error tails): gloo's connection
#: lines (one per collective group and rank, printed from several threads at once, so interleaved),
#: absl's pre-init notice, and JAX's preemption notifier announcing the SIGTERM that ends a group.
QUIET_PATTERNS = re.compile(r"\[Gloo\]|connected peer ranks|^WARNING: All log messages before absl::InitializeLog|"
                            r"preemption_notifier\.cc.*SIGTERM caught")
_RECORD_HEADER = struct.Struct("<I")


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What one rank's task needs (travels to its worker; ``fn`` and ``args`` once per group)."""

    group: str
    rank: int
    size: int
    coordinator: str
    fn: Any
    args: tuple
    devices_per_process: int | None
    initialization_timeout: float
    heartbeat_timeout: float
    shutdown_timeout: float
    forward_records: bool
    cpus: tuple[int, ...] | None = None  # the CPUs the rank's process is bound to (cpus_per_process)


# -- inside a rank -----------------------------------------------------------------------------------
_reporter: dict[str, Any] = {}


def _install_reporter(rank: int, record_fd: int) -> None:
    _reporter.update(rank=rank, file=os.fdopen(record_fd, "wb", buffering=0), lock=threading.Lock())


def report_progress(record: dict) -> bool:
    """Send ``record`` (a dict of numbers and small arrays) from a rank of a :func:`run_spmd`
    group to the caller's ``on_record``; returns whether it was sent (False outside a group)."""
    if not _reporter:
        return False
    import cloudpickle

    data = cloudpickle.dumps(record)
    with _reporter["lock"]:
        _reporter["file"].write(_RECORD_HEADER.pack(len(data)) + data)
    return True


def spmd_rank() -> int | None:
    """This process's rank in a :func:`run_spmd` group (``None`` outside one)."""
    return _reporter.get("rank")


DASK_MALLOC_TRIM_THRESHOLD = 65536  # distributed's default nanny.pre-spawn-environ value; see rank_environment


# -- the task on a worker: one rank's process ----------------------------------------------------------
def rank_environment(spec: RankSpec, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The rank's environment: the worker's, plus gloo collectives, the simulated CPU device count
    (replacing a forced one in ``XLA_FLAGS``) and the worker's ``sys.path``, so functions pickled by
    reference import.

    Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` in its workers (``distributed.nanny.pre-spawn-environ``)
    to hand freed memory back to the OS; a fixed threshold also turns off glibc's dynamic mmap threshold, so
    every large buffer of every step is a fresh ``mmap`` and page faults: a JAX step on one core ran 26% slower
    (110 ms against 87 ms, ``benchmarks/multi_process.py``'s layer sizes). The rank drops that value and keeps
    glibc's default; any other value (set on purpose) is kept."""
    environment = dict(os.environ if environ is None else environ)
    if environment.get("MALLOC_TRIM_THRESHOLD_") == str(DASK_MALLOC_TRIM_THRESHOLD):
        del environment["MALLOC_TRIM_THRESHOLD_"]
    environment.setdefault("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")
    if spec.devices_per_process is not None:
        environment["JAX_NUM_CPU_DEVICES"] = str(spec.devices_per_process)
        flags = [f for f in environment.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
        environment["XLA_FLAGS"] = " ".join(flags)
    environment["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    environment["PYTHONUNBUFFERED"] = "1"
    return environment


def _end(process: subprocess.Popen) -> None:
    """SIGTERM the rank's process group, SIGKILL it after the grace period; reap it."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, 10.0)):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    try:  # whatever it started in its group, even after it exited
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_records(fd: int, sink: list, lock: threading.Lock) -> None:
    import cloudpickle

    with os.fdopen(fd, "rb") as pipe:
        while True:
            header = pipe.read(_RECORD_HEADER.size)
            if len(header) < _RECORD_HEADER.size:
                return
            data = pipe.read(_RECORD_HEADER.unpack(header)[0])
            with lock:
                sink.append(cloudpickle.loads(data))


def _read_lines(stream: Any, sink: list, tail: deque, lock: threading.Lock) -> None:
    for raw in stream:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            tail.append(line)
            if not QUIET_PATTERNS.search(line):
                sink.append(line)


def run_rank(spec: RankSpec) -> _Outcome:
    """The task of one rank (on its worker): start the rank's process, forward its output and
    records, end it when the group's stop event is set; its ``fn``'s value or its
    :class:`RankFailedError`, as an :class:`_Outcome`."""
    import cloudpickle
    from distributed import Event, Queue, get_client

    secede_if_on_worker()  # the worker's thread slot is free while the rank runs
    client = get_client()
    queue, stop = Queue(spec.group, client=client), Event(f"{spec.group}-stop", client=client)
    with tempfile.TemporaryDirectory(prefix=f"carlskit-rank{spec.rank}-") as folder:
        payload, result = os.path.join(folder, "payload"), os.path.join(folder, "result")
        with open(payload, "wb") as file:
            cloudpickle.dump(spec, file)
        read_fd, write_fd = os.pipe()
        process = subprocess.Popen(
            [sys.executable, "-m", "carlskit.cluster._rank", payload, result, str(write_fd), str(os.getpid())],
            env=rank_environment(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        lines: list[str] = []
        records: list[dict] = []
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        lock = threading.Lock()
        readers = [threading.Thread(target=_read_lines, args=(process.stdout, lines, tail, lock), daemon=True),
                   threading.Thread(target=_read_records, args=(read_fd, records, lock), daemon=True)]
        for reader in readers:
            reader.start()

        def forward() -> None:
            with lock:
                batch = {"rank": spec.rank, "lines": lines[:], "records": records[:] if spec.forward_records else []}
                lines.clear()
                records.clear()
            if batch["lines"] or batch["records"]:
                queue.put(batch)

        stopped = False
        try:
            while process.poll() is None:
                forward()
                if stop.is_set():
                    stopped = True
                    break
                time.sleep(POLL_SECONDS)
        finally:
            _end(process)
            for reader in readers:
                reader.join(5.0)
            forward()
        if stopped:
            return _Outcome(False, RankFailedError(spec.rank, "ended", "was ended with its group", "\n".join(tail)))
        if os.path.exists(result):
            with open(result, "rb") as file:
                status, value = cloudpickle.load(file)
            if status == "ok":
                return _Outcome(True, value)
            error = RankFailedError(spec.rank, "raised", f"raised {value['type']}: {value['message']}",
                                    value["traceback"])
            cause = cloudpickle.loads(value["exception"]) if "exception" in value else None
            return _Outcome(False, error, cause)
        code = process.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return _Outcome(False, RankFailedError(spec.rank, "exited", f"{how} before returning a value",
                                               "\n".join(tail)))


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What a rank's task returns: its value, or its failure (returned, not raised, so the workers'
    logs hold no 'Compute Failed' for what the caller reports once)."""

    ok: bool
    value: Any
    cause: BaseException | None = None  # the rank's own exception (a pickled __cause__ would be dropped)


def free_port() -> int:
    """A TCP port free on this host now (the coordinator binds it moments later)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


# -- the caller ----------------------------------------------------------------------------------------
def group_candidates(client: Any, placement: Placement) -> list[str]:
    """Live workers a group may use, sorted: the placement's when it names any, else the
    accelerator workers if there are any, else every worker."""
    if placement.restricted:
        return placement.candidates(client)
    workers = live_workers(client)
    accelerators = sorted(a for a, info in workers.items() if is_accelerator(info.get("resources") or {}))
    return accelerators or sorted(workers)


def run_spmd(client: Any, fn: Callable[..., Any], *args: Any, processes: int, devices_per_process: int | None = None,
             workers: list[str] | str | None = None, resources: dict[str, float] | None = None,
             timeout: float | None = None, stall_timeout: float | None = None,
             initialization_timeout: float = 60.0, heartbeat_timeout: float = 30.0,
             restart_policy: Any = None, on_record: Callable[[dict], None] | None = None,
             output: bool | Callable[[int, str], None] = True, stop: threading.Event | None = None,
             on_restart: Callable[[BaseException, float], None] | None = None,
             cpus_per_process: int | None = None) -> list[Any]:
    """Run ``fn(*args)`` once in each of ``processes`` fresh JAX processes on Dask workers, as one
    JAX program (``jax.distributed``: ``jax.devices()`` lists every rank's devices).

    Args:
      client: a ``distributed.Client``.
      fn: a picklable function; it runs after ``jax.distributed.initialize`` (``jax.process_index()``
        is its rank).
      processes: the group's size; each rank on its own worker.
      devices_per_process: simulated CPU devices per rank (``JAX_NUM_CPU_DEVICES``); ``None``: the
        devices its worker sees (on GPU/TPU, one worker per accelerator or host).
      workers, resources: where the ranks may run (:class:`carlskit.cluster.Placement`); by default
        the accelerator workers if there are any, else all.
      timeout: seconds the whole group may run (``None``: no limit).
      stall_timeout: seconds without a :func:`report_progress` record once one was sent, after which
        the group counts as hung (``None``: not watched).
      initialization_timeout, heartbeat_timeout: ``jax.distributed.initialize``'s (module docstring).
      restart_policy: relaunch the group on live workers after a lost worker, under this
        :class:`carlskit.RestartPolicy` (or budget in seconds); ``None``: raise at once.
      on_record: called in the caller with each record rank 0 reports.
      output: print each rank's output lines tagged ``[rank r]`` (``True``), drop them (``False``), or
        pass ``(rank, line)`` to a function.
      stop: a ``threading.Event``; once set, every rank is ended and ``RankFailedError`` (``kind=
        "stopped"``) raised (a fit's ``FitHandle.stop``).
      on_restart: called with ``(error, delay_seconds)`` before each relaunch.
      cpus_per_process: bind each rank's process (every thread, before JAX starts) to this many CPUs
        of its host, disjoint from the other ranks on that host (``mpirun --bind-to core``). JAX sizes
        its CPU thread pool from the CPUs a process may use, so ranks sharing a host then compute
        side by side instead of each running a pool as large as the host; ``None``: not bound.
        ValueError (from the rank's worker) when the host has too few.

    Returns:
      ``fn``'s values, in rank order.

    Raises:
      RankFailedError: a rank raised, exited or the group timed out (every rank ended).
      RankLostError: a rank's worker was lost (and the restart policy, if any, gave up:
        :class:`carlskit.ServiceGaveUpError` is raised from it then).
      NoWorkerError: fewer than ``processes`` live workers match.
    """
    if not callable(getattr(client, "submit", None)):
        raise TypeError(f"client must be a dask.distributed.Client, got {type(client).__name__}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    processes = positive_int(processes, "processes")
    if devices_per_process is not None:
        devices_per_process = positive_int(devices_per_process, "devices_per_process")
    if cpus_per_process is not None:
        cpus_per_process = positive_int(cpus_per_process, "cpus_per_process")
    for name, value in (("timeout", timeout), ("stall_timeout", stall_timeout)):
        if value is not None:
            positive_float(value, name)
    positive_float(initialization_timeout, "initialization_timeout")
    positive_float(heartbeat_timeout, "heartbeat_timeout")
    if not (isinstance(output, bool) or callable(output)):
        raise TypeError(f"output must be a bool or a function of (rank, line), got {type(output).__name__}")
    placement = Placement.of(workers, resources)
    group = _Group(client, fn, args, processes, devices_per_process, placement, timeout, stall_timeout,
                   initialization_timeout, heartbeat_timeout, on_record, output, stop, cpus_per_process)
    if restart_policy is None:
        return group.run()
    from carlskit.cluster._policy import restart_policy as policy_of

    return retry_on_worker_loss(group.run, policy=policy_of(restart_policy),
                                what=f"the process group of {processes} ranks", on_retry=on_restart)


class _Group:
    """One :func:`run_spmd` call: each :meth:`run` launches the group once and follows it."""

    def __init__(self, client, fn, args, processes, devices_per_process, placement, timeout, stall_timeout,
                 initialization_timeout, heartbeat_timeout, on_record, output, stop=None, cpus_per_process=None):
        self.client, self.fn, self.args, self.processes = client, fn, args, processes
        self.devices_per_process, self.placement = devices_per_process, placement
        self.timeout, self.stall_timeout = timeout, stall_timeout
        self.initialization_timeout, self.heartbeat_timeout = initialization_timeout, heartbeat_timeout
        self.on_record, self.output, self.stop = on_record, output, stop
        self.cpus_per_process = cpus_per_process
        self.launches = 0

    def _print(self, rank: int, line: str) -> None:
        if self.output is True:
            print(f"[rank {rank}] {line}", flush=True)
        elif callable(self.output):
            self.output(rank, line)

    def run(self) -> list[Any]:
        from distributed import Event, Queue
        from distributed.comm import get_address_host

        candidates = group_candidates(self.client, self.placement)
        if len(candidates) < self.processes:
            raise NoWorkerError(f"a group of {self.processes} processes needs as many live workers matching "
                                f"{self.placement}; {len(candidates)} are: {candidates}")
        chosen = candidates[: self.processes]
        self.launches += 1
        group = f"carlskit-spmd-{uuid.uuid4().hex[:12]}"
        port = self.client.submit(free_port, workers=[chosen[0]], allow_other_workers=False, pure=False,
                                  key=f"{group}-port").result(timeout=60)
        coordinator = f"{get_address_host(chosen[0])}:{port}"
        queue, stop = Queue(group, client=self.client), Event(f"{group}-stop", client=self.client)
        # fn and args travel once to the chosen workers, not once per rank through the scheduler
        [shipped] = self.client.scatter([(self.fn, self.args)], workers=chosen, broadcast=True, hash=False)
        hosts = [get_address_host(address) for address in chosen]  # a rank's place among those on its host
        futures = [self.client.submit(_start_rank, shipped, group, rank, self.processes, coordinator,
                                      self.devices_per_process, self.initialization_timeout, self.heartbeat_timeout,
                                      self.cpus_per_process, hosts[:rank].count(hosts[rank]),
                                      workers=[address], allow_other_workers=False, pure=False,
                                      key=f"{group}-rank{rank}")
                   for rank, address in enumerate(chosen)]
        try:
            return self._follow(futures, chosen, queue, stop)
        finally:
            stop.set()
            self._wind_down(futures, chosen, queue)

    def _drain(self, queue: Any) -> None:
        for batch in queue.get(batch=True):
            for line in batch["lines"]:
                self._print(batch["rank"], line)
            if self.on_record is not None and batch["rank"] == 0:
                for record in batch["records"]:
                    self.on_record(record)
            if batch["records"]:
                self.last_progress = time.monotonic()

    def _follow(self, futures: list, chosen: list[str], queue: Any, stop: Any) -> list[Any]:
        started = checked = time.monotonic()
        self.last_progress = None
        outcomes: dict[int, _Outcome] = {}
        while True:
            self._drain(queue)
            for rank, future in enumerate(futures):
                if rank not in outcomes and future.status == "finished":
                    outcomes[rank] = future.result()
                elif rank not in outcomes and future.status == "error":  # the task itself broke
                    outcomes[rank] = _Outcome(False, future.exception())
            if len(outcomes) == len(futures) and all(o.ok for o in outcomes.values()):
                self._drain(queue)
                return [outcomes[rank].value for rank in range(len(futures))]
            failed = any(not o.ok for o in outcomes.values())
            now = time.monotonic()
            if failed or now - checked >= LIVENESS_SECONDS:
                checked = now
                live = live_workers(self.client)
                lost = [rank for rank, address in enumerate(chosen) if address not in live]
                if lost:
                    stop.set()
                    raise RankLostError(lost[0], chosen[lost[0]])
            if failed:
                stop.set()
                raise self._root_cause(futures, outcomes)
            if self.stop is not None and self.stop.is_set():
                stop.set()
                raise RankFailedError(None, "stopped", "was stopped by the caller")
            if self.timeout is not None and now - started > self.timeout:
                stop.set()
                raise RankFailedError(None, "timed out", f"ran past timeout={self.timeout:g} s")
            if (self.stall_timeout is not None and self.last_progress is not None
                    and now - self.last_progress > self.stall_timeout):
                stop.set()
                raise RankFailedError(None, "timed out", f"reported no progress for stall_timeout="
                                      f"{self.stall_timeout:g} s (a rank stuck before a collective holds the rest)")
            time.sleep(POLL_SECONDS)

    def _root_cause(self, futures: list, outcomes: dict[int, _Outcome]) -> BaseException:
        """The error to raise: a rank's own exception before a rank that exited (often a peer the
        runtime aborted because of it), before one ended with the group."""
        deadline = time.monotonic() + KILL_GRACE_SECONDS + 1.0
        while time.monotonic() < deadline and any(f.status == "pending" for f in futures):
            time.sleep(POLL_SECONDS)  # the others end now (stop is set): their errors tell more
        for rank, future in enumerate(futures):
            if rank not in outcomes and future.status == "finished":
                outcomes[rank] = future.result()
        order = {"raised": 0, "exited": 1, "ended": 2}  # a task that broke before its rank started: first
        failures = [o for o in outcomes.values() if not o.ok]
        first = min(failures, key=lambda o: order.get(o.value.kind, 3) if isinstance(o.value, RankFailedError) else -1)
        first.value.__cause__ = first.cause
        return first.value

    def _wind_down(self, futures: list, chosen: list[str], queue: Any) -> None:
        """After the group ends: let every task end its rank (stop is set), drain the last output,
        cancel tasks stuck on a lost worker (at once: they would wait for its address forever)."""
        try:
            live = live_workers(self.client)
        except Exception:  # noqa: BLE001 - no answer: wait for every task as below
            live = set(chosen)
        waiting = [f for f, address in zip(futures, chosen) if address in live]
        deadline = time.monotonic() + KILL_GRACE_SECONDS + 5.0
        while time.monotonic() < deadline and any(f.status == "pending" for f in waiting):
            time.sleep(POLL_SECONDS)
        try:
            self._drain(queue)
        except Exception:  # noqa: BLE001 - the client is closing
            pass
        for future in futures:
            if future.status == "pending":
                future.cancel()
            future.release()


def rank_cpus(cpus_per_process: int | None, local_index: int) -> tuple[int, ...] | None:
    """The CPUs of this host a rank binds to: block ``local_index`` (the rank's place among the
    group's ranks on this host) of ``cpus_per_process`` CPUs of those this worker may use, so the
    ranks sharing a host never share a CPU (``mpirun --bind-to core``); ``None``: not bound."""
    if cpus_per_process is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cpus_per_process binds ranks to CPUs with os.sched_setaffinity (Linux); this host "
                         "has none: leave cpus_per_process=None")
    usable = sorted(os.sched_getaffinity(0))
    first = local_index * cpus_per_process
    if first + cpus_per_process > len(usable):
        raise ValueError(f"cpus_per_process={cpus_per_process}: {local_index + 1} ranks of the group share this "
                         f"host, which lets its workers use {len(usable)} CPUs ({usable}); at most "
                         f"{len(usable) // (local_index + 1)} per rank")
    return tuple(usable[first:first + cpus_per_process])


def _start_rank(shipped: tuple, group: str, rank: int, size: int, coordinator: str, devices_per_process: int | None,
                initialization_timeout: float, heartbeat_timeout: float, cpus_per_process: int | None = None,
                local_index: int = 0) -> Any:
    fn, args = shipped
    return run_rank(RankSpec(group, rank, size, coordinator, fn, args, devices_per_process, initialization_timeout,
                             heartbeat_timeout, shutdown_timeout=30.0, forward_records=rank == 0,
                             cpus=rank_cpus(cpus_per_process, local_index)))
