"""KnowledgeBank benchmark: lookup vs numpy, nearest vs faiss, distributed throughput, memory.

Run from the repo root: ``python benchmarks/kb.py`` (1,000,000 x 64 table) or ``--small``
(or CARLSKIT_SMALL=1: 100,000 rows). Prints progress, then ONE JSON object as the last line.
Every ratio compares against a baseline measured in the same process on the same data.

Distributed keys (2 shards on 2 worker processes, batches of 4096; the variants take turns every 25
batches and each figure is the median over those slices, so all see the same load):
``dist_lookup_rows_per_s`` is blocking ``lookup`` calls one after another on the bank's default
(direct, ZeroMQ) data path (the issue's target); ``dist_lookup_dask_rows_per_s`` is the same calls
to the same shards through Dask's actor RPC only (``dist_lookup_direct_over_dask`` their ratio);
``dist_lookup_pipelined_rows_per_s`` keeps ``IN_FLIGHT`` batches in flight with ``lookup_async``;
``dist_floor_rows_per_s`` (and ``_pipelined``) is the same traffic through Dask's actor RPC to an
actor that does no work (2048 keys in, 2048 x 64 float32 out, per worker): the most the actor RPC
allows here. ``dist_ping_all_shards_ms`` / ``dist_ping_dask_ms``: a no-work round trip to both
shards on each path. ``dist_apply_gradients_wal_rows_per_s`` / ``_wal_machine_rows_per_s``: the
blocking ``apply_gradients`` calls with the shards' write-ahead log on, ``durability="process"`` (no
fsync) / ``"machine"`` (a group fdatasync before each acknowledgement); ``--part wal`` runs only
those and the log-free baseline.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from carlskit.bank import KnowledgeBank  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleave, medians, ratio  # noqa: E402

DIM = 64
BATCH = 4096
#: batches kept in flight by the pipelined variants (lookup_async / apply_gradients_async)
IN_FLIGHT = 4
#: the distributed variants take turns every CYCLE_BATCHES batches
CYCLE_BATCHES = 25


def resident_bytes() -> int:
    """VmRSS after returning freed heap pages to the OS (glibc malloc_trim), in bytes."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def median_seconds(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def side_by_side(baseline, candidate, repeats: int, key: str, calls: int = 1) -> tuple[float, float, dict]:
    """Median seconds per call of two functions measured interleaved (``benchmarks/_timing.py``),
    each sample ``calls`` calls in a row, and ``{key: median of baseline / candidate per repeat,
    key_spread: ...}``."""

    def block(function):
        def run() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                function()
            return (time.perf_counter() - start) / calls

        return run

    samples = interleave({"baseline": block(baseline), "candidate": block(candidate)}, repeats)
    times = medians(samples)
    return times["baseline"], times["candidate"], ratio(samples, "baseline", "candidate", key)


def make_chunks(num_rows: int, chunk: int = 100_000):
    rng = np.random.default_rng(0)
    keys = rng.choice(np.int64(1) << 40, size=num_rows, replace=False).astype(np.int64)
    for start in range(0, num_rows, chunk):
        yield keys[start:start + chunk], rng.standard_normal(
            (min(chunk, num_rows - start), DIM), dtype=np.float32)


def in_process(num_rows: int, repeats: int) -> dict:
    results: dict = {}
    rss_before = resident_bytes()
    kb = KnowledgeBank()
    kb.create_table("emb", dim=DIM, initializer="zeros")
    all_keys = []
    for keys, values in make_chunks(num_rows):
        kb.update("emb", keys, values, version=0)
        all_keys.append(keys)
        del values
    all_keys = np.concatenate(all_keys)
    raw_bytes = num_rows * DIM * 4
    results["memory_ratio"] = (resident_bytes() - rss_before) / raw_bytes
    results["memory_ratio_accounted"] = kb.stats()["tables"]["emb"]["resident_bytes"] / raw_bytes
    print(f"filled {num_rows} rows; memory ratio {results['memory_ratio']:.3f}", flush=True)

    raw = np.concatenate([values for _, values in make_chunks(num_rows)])  # same data, same order
    rng = np.random.default_rng(1)
    positions = rng.integers(0, num_rows, BATCH)
    keys = all_keys[positions]
    assert np.array_equal(kb.lookup("emb", keys)[0], raw[positions])
    # One call per sample, alternated call by call (as before the interleaving helper): the two
    # calls of a pair are then a millisecond apart.
    t_numpy, t_bank, lookup_ratio = side_by_side(lambda: raw[positions], lambda: kb.lookup("emb", keys), repeats,
                                                 "lookup_vs_numpy")
    results.update(lookup_numpy_ms=t_numpy * 1e3, lookup_bank_ms=t_bank * 1e3, **lookup_ratio)
    results["inprocess_call_overhead_us"] = median_seconds(
        lambda: kb.lookup("emb", keys[:1]), repeats) * 1e6
    print(f"lookup: numpy {t_numpy * 1e3:.3f} ms, bank {t_bank * 1e3:.3f} ms", flush=True)

    import faiss
    index = faiss.IndexFlatIP(DIM)
    index.add(raw)
    queries = rng.standard_normal((256, DIM), dtype=np.float32)
    expected = all_keys[index.search(queries, 10)[1]]
    got = kb.nearest("emb", queries, k=10, metric="dot")[0]
    results["nearest_agreement"] = float((got == expected).mean())
    nearest_repeats = max(3, repeats // 40)
    t_faiss, t_near, nearest_ratio = side_by_side(lambda: index.search(queries, 10),
                                                  lambda: kb.nearest("emb", queries, k=10), nearest_repeats,
                                                  "nearest_vs_faiss")
    results.update(nearest_faiss_ms=t_faiss * 1e3, nearest_bank_ms=t_near * 1e3, **nearest_ratio)
    print(f"nearest: faiss {t_faiss * 1e3:.1f} ms, bank {t_near * 1e3:.1f} ms", flush=True)
    return results


class EchoShard:
    """The floor: a Dask actor that receives keys and returns rows, doing no work at all."""

    def __init__(self, dim: int, rows: int) -> None:
        self.rows = np.zeros((rows, dim), np.float32)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        return self.rows[: len(keys)]


class AllOf:
    """Several Dask actor futures as one: ``result()`` waits for all (like a BankFuture)."""

    def __init__(self, futures: list) -> None:
        self.futures = futures

    def result(self) -> list:
        return [future.result() for future in self.futures]


def seconds_for(submit, batches: list[np.ndarray], in_flight: int) -> float:
    """Seconds to run ``submit(batch).result()`` over ``batches``, keeping ``in_flight`` batches
    sent and not yet waited for (1: one blocking call after the other)."""
    window: collections.deque = collections.deque()
    start = time.perf_counter()
    for batch in batches:
        window.append(submit(batch))
        if len(window) >= in_flight:
            window.popleft().result()
    while window:
        window.popleft().result()
    return time.perf_counter() - start


WAL_VARIANTS = ("dist_apply_gradients_rows_per_s", "dist_apply_gradients_wal_rows_per_s",
                "dist_apply_gradients_wal_machine_rows_per_s")


def distributed_mode(num_rows: int, calls: int, only: tuple[str, ...] | None = None) -> dict:
    """2 shards on 2 worker processes, ``calls`` batches of ``BATCH`` random keys per variant
    (``only``: just these variants)."""
    from distributed import Client, LocalCluster

    results: dict = {}
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      os.environ.get("PYTHONPATH")]))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, \
            Client(cluster, direct_to_workers=True) as client:
        kb = KnowledgeBank(client, num_shards=2)
        kb.create_table("emb", dim=DIM, initializer="zeros", capacity=num_rows)
        all_keys = []
        for keys, values in make_chunks(num_rows, chunk=50_000):
            kb.update("emb", keys, values, version=0)
            all_keys.append(keys)
        all_keys = np.concatenate(all_keys)
        rng = np.random.default_rng(2)
        batches = [all_keys[rng.integers(0, num_rows, BATCH)] for _ in range(calls)]
        gradients = rng.standard_normal((BATCH, DIM), dtype=np.float32) * np.float32(1e-3)
        echoes = [client.submit(EchoShard, DIM, BATCH, actor=True, workers=[worker],
                                pure=False).result() for worker in kb.shard_workers]
        # the same shards reached through Dask's actor RPC only (the transport before the direct path)
        kb_dask = KnowledgeBank._over(kb._shards.with_direct(None))
        assert kb.transport == "direct" and kb_dask.transport == "dask", kb.transport
        half = BATCH // 2
        print(f"distributed: filled {num_rows} rows on 2 workers", flush=True)

        def echo(batch):
            return AllOf([shard.lookup(part, separate_thread=False)
                          for shard, part in zip(echoes, (batch[:half], batch[half:]))])

        variants = {
            "dist_floor_rows_per_s": (echo, 1),
            "dist_floor_pipelined_rows_per_s": (echo, IN_FLIGHT),
            "dist_lookup_rows_per_s": (lambda b: kb.lookup_async("emb", b), 1),
            "dist_lookup_dask_rows_per_s": (lambda b: kb_dask.lookup_async("emb", b), 1),
            "dist_lookup_pipelined_rows_per_s": (lambda b: kb.lookup_async("emb", b), IN_FLIGHT),
            "dist_apply_gradients_rows_per_s": (
                lambda b: kb.apply_gradients_async("emb", b, gradients), 1),
            "dist_apply_gradients_dask_rows_per_s": (
                lambda b: kb_dask.apply_gradients_async("emb", b, gradients), 1),
            # lookups that also apply (flush) the gradients cached by the previous variant
            "dist_lookup_with_flush_rows_per_s": (lambda b: kb.lookup_async("emb", b), 1),
            "dist_apply_gradients_pipelined_rows_per_s": (
                lambda b: kb.apply_gradients_async("emb", b, gradients), IN_FLIGHT),
            # the same calls with the shards' write-ahead log on (see wal_on / wal_off below)
            "dist_apply_gradients_wal_rows_per_s": (
                lambda b: kb.apply_gradients_async("emb", b, gradients), 1),
            # ... and with durability="machine": acknowledged after a group fdatasync
            "dist_apply_gradients_wal_machine_rows_per_s": (
                lambda b: kb.apply_gradients_async("emb", b, gradients), 1),
        }
        if only is not None:
            variants = {name: variant for name, variant in variants.items() if name in only}
        wal_directory = tempfile.mkdtemp(prefix="carlskit-kb-bench-wal-")
        logged = {"dist_apply_gradients_wal_rows_per_s": "process",
                  "dist_apply_gradients_wal_machine_rows_per_s": "machine"}

        def wal_on(durability):  # a snapshot starts a new log segment (the only way the log may start)
            kb.enable_snapshots(wal_directory, write_ahead_log=True, durability=durability, keep=1)

        def wal_off():
            kb._shards.call_all("stop_write_ahead_log")
        wal_on("process")
        wal_off()
        for submit, in_flight in variants.values():  # warm-up
            seconds_for(submit, batches[:in_flight], in_flight)
        # The variants take turns on short slices of the batches, so that every variant sees the
        # same load from other processes; a figure is the median over the slices.
        measured: dict = {name: [] for name in variants}
        loads = []
        for first in range(0, len(batches), CYCLE_BATCHES):
            part = batches[first:first + CYCLE_BATCHES]
            for name, (submit, in_flight) in variants.items():
                if name in logged:
                    wal_on(logged[name])
                measured[name].append(len(part) * BATCH / seconds_for(submit, part, in_flight))
                if name in logged:
                    wal_off()
            kb.flush("emb")
            loads.append(os.getloadavg()[0])
        print(", ".join(f"{name[5:-11]} {statistics.median(values) / 1e6:.2f}M"
                        for name, values in measured.items()), flush=True)
        for name, values in measured.items():
            results[name] = statistics.median(values)
        results["dist_cycles"] = len(loads)
        results["dist_apply_gradients_wal_over_no_wal"] = (
            results["dist_apply_gradients_wal_rows_per_s"] / results["dist_apply_gradients_rows_per_s"])
        results["dist_apply_gradients_wal_machine_over_no_wal"] = (
            results["dist_apply_gradients_wal_machine_rows_per_s"] / results["dist_apply_gradients_rows_per_s"])
        results["dist_apply_gradients_wal_machine_over_wal"] = (
            results["dist_apply_gradients_wal_machine_rows_per_s"] / results["dist_apply_gradients_wal_rows_per_s"])
        results["dist_load_average_1min"] = statistics.median(loads)
        if only is not None:
            kb.close()
            shutil.rmtree(wal_directory, ignore_errors=True)
            return results
        results["dist_lookup_vs_floor"] = (results["dist_lookup_rows_per_s"]
                                           / results["dist_floor_rows_per_s"])
        results["dist_in_flight"] = IN_FLIGHT
        results["dist_load_average_1min"] = statistics.median(loads)
        results["dist_lookup_direct_over_dask"] = (results["dist_lookup_rows_per_s"]
                                                   / results["dist_lookup_dask_rows_per_s"])
        results["dist_ping_all_shards_ms"] = median_seconds(kb.ping, 50) * 1e3  # direct path
        results["dist_ping_dask_ms"] = median_seconds(kb_dask.ping, 50) * 1e3  # Dask RPC alone
        results["dist_lookup_latency_ms"] = median_seconds(
            lambda: kb.lookup("emb", batches[0]), 50) * 1e3
        one = all_keys[:1]
        results["dist_call_overhead_ms"] = median_seconds(lambda: kb.lookup("emb", one), 50) * 1e3
        two = all_keys[[0, 1, 2, 3, 4, 5, 6, 7]]  # almost surely touches both shards
        results["dist_two_shard_call_overhead_ms"] = median_seconds(
            lambda: kb.lookup("emb", two), 50) * 1e3
        stats = kb.stats()["tables"]["emb"]
        results["dist_pending_after_bench"] = stats["pending_gradients"]
        kb.close()
        shutil.rmtree(wal_directory, ignore_errors=True)
    print(f"distributed: lookup {results['dist_lookup_rows_per_s']:.3g} rows/s "
          f"({results['dist_lookup_pipelined_rows_per_s']:.3g} with {IN_FLIGHT} in flight; floor "
          f"{results['dist_floor_rows_per_s']:.3g}), apply_gradients "
          f"{results['dist_apply_gradients_rows_per_s']:.3g} rows/s", flush=True)
    return results


def snapshot_bytes(kb: KnowledgeBank) -> list[np.ndarray]:
    """The arrays a snapshot of in-process ``kb`` writes (every table, every shard), as views."""
    arrays = []
    for shard in kb._shards:
        for table in shard._tables.values():
            arrays += [array for _, array in table.snapshot_columns()[0]]
    return arrays


def np_save_all(arrays: list[np.ndarray], directory: str) -> None:
    """The baseline: ``np.save`` of the same arrays, one file each, fsync'd like a snapshot part."""
    os.makedirs(directory)
    for number, array in enumerate(arrays):
        with open(os.path.join(directory, f"{number}.npy"), "wb") as handle:
            np.save(handle, array)
            handle.flush()
            os.fsync(handle.fileno())


def np_load_all(directory: str, count: int) -> list[np.ndarray]:
    return [np.load(os.path.join(directory, f"{number}.npy")) for number in range(count)]


class PeakResident:
    """Peak VmRSS of this process while a block runs (sampled every 5 ms in a thread)."""

    def __enter__(self):
        import threading

        self.before = resident_bytes()
        self.peak = self.before
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                with open("/proc/self/status") as handle:
                    for line in handle:
                        if line.startswith("VmRSS:"):
                            self.peak = max(self.peak, int(line.split()[1]) * 1024)
                self._stop.wait(0.005)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.before


def fill(kb: KnowledgeBank, num_rows: int) -> np.ndarray:
    kb.create_table("emb", dim=DIM, initializer="zeros", capacity=num_rows)
    all_keys = []
    for keys, values in make_chunks(num_rows, chunk=50_000):
        kb.update("emb", keys, values, version=0)
        all_keys.append(keys)
    return np.concatenate(all_keys)


def snapshot_in_process(num_rows: int, repeats: int, directory: str) -> dict:
    """``snapshot_save_vs_npsave`` / ``snapshot_load_vs_npload``: KnowledgeBank.save / load of a
    one-shard bank against np.save (+ fsync) / np.load of the very arrays the snapshot holds."""
    import shutil

    kb = KnowledgeBank()
    fill(kb, num_rows)
    arrays = snapshot_bytes(kb)
    total = sum(array.nbytes for array in arrays)
    counter = iter(range(10**6))
    paths: dict = {}

    def save_bank():
        path = paths["bank"] = os.path.join(directory, f"bank-{next(counter)}")
        kb.save(path)

    def save_numpy():
        path = paths["numpy"] = os.path.join(directory, f"numpy-{next(counter)}")
        np_save_all(arrays, path)

    saves_numpy, saves_bank = [], []
    loads_numpy, loads_bank = [], []
    for _ in range(repeats):  # alternate, so both see the same load from other processes
        for runs, function in ((saves_numpy, save_numpy), (saves_bank, save_bank)):
            start = time.perf_counter()
            function()
            runs.append(time.perf_counter() - start)
        start = time.perf_counter()
        loaded = np_load_all(paths["numpy"], len(arrays))
        loads_numpy.append(time.perf_counter() - start)
        del loaded
        start = time.perf_counter()
        restored = KnowledgeBank.load(paths["bank"])
        loads_bank.append(time.perf_counter() - start)
        assert restored.stats()["tables"]["emb"]["rows"] == num_rows
        restored.close()
        del restored
        for path in paths.values():
            shutil.rmtree(path)
    t_save_np, t_save = statistics.median(saves_numpy), statistics.median(saves_bank)
    t_load_np, t_load = statistics.median(loads_numpy), statistics.median(loads_bank)
    print(f"snapshot {total / 1e6:.0f} MB: save {t_save:.2f} s (np.save {t_save_np:.2f} s), "
          f"load {t_load:.2f} s (np.load {t_load_np:.2f} s)", flush=True)
    return {"snapshot_rows": num_rows, "snapshot_mb": total / 1e6,
            "snapshot_save_s": t_save, "snapshot_npsave_s": t_save_np,
            "snapshot_load_s": t_load, "snapshot_npload_s": t_load_np,
            "snapshot_save_vs_npsave": t_save_np / t_save,
            "snapshot_load_vs_npload": t_load_np / t_load}


def snapshot_distributed(num_rows: int, directory: str) -> dict:
    """2 shards on 2 workers: save / load MB/s and the client's memory growth over the values'
    bytes (``dist_snapshot_client_growth_ratio``: the larger of save and load)."""
    from distributed import Client, LocalCluster

    results: dict = {}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        kb = KnowledgeBank(client, num_shards=2)
        fill(kb, num_rows)
        values_bytes = num_rows * DIM * 4
        path = os.path.join(directory, "dist")
        with PeakResident() as save_memory:
            start = time.perf_counter()
            kb.save(path)
            save_seconds = time.perf_counter() - start
        kb.close()
        size = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))
        with PeakResident() as load_memory:
            start = time.perf_counter()
            restored = KnowledgeBank.load(path, client)
            load_seconds = time.perf_counter() - start
        assert restored.stats()["tables"]["emb"]["rows"] == num_rows
        restored.close()
    results.update(
        dist_snapshot_rows=num_rows, dist_snapshot_mb=size / 1e6,
        dist_snapshot_save_mb_per_s=size / 1e6 / save_seconds,
        dist_snapshot_load_mb_per_s=size / 1e6 / load_seconds,
        dist_snapshot_save_client_growth_mb=save_memory.growth / 1e6,
        dist_snapshot_load_client_growth_mb=load_memory.growth / 1e6,
        dist_snapshot_client_growth_ratio=max(save_memory.growth, load_memory.growth) / values_bytes)
    print(f"distributed snapshot {size / 1e6:.0f} MB: save {results['dist_snapshot_save_mb_per_s']:.0f}"
          f" MB/s, load {results['dist_snapshot_load_mb_per_s']:.0f} MB/s, client growth "
          f"{save_memory.growth / 1e6:.0f} / {load_memory.growth / 1e6:.0f} MB", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="100k rows, fewer repeats")
    parser.add_argument("--part", choices=["all", "inprocess", "distributed", "snapshot", "wal"],
                        default="all")
    parser.add_argument("--snapshot-rows", type=int, default=None,
                        help="rows of the snapshot benchmarks (default 4,000,000; 200,000 --small)")
    parser.add_argument("--snapshot-dir", default=None,
                        help="where snapshots are written (default: a temporary directory)")
    args = parser.parse_args()
    small = args.small or os.environ.get("CARLSKIT_SMALL") == "1"
    num_rows = 100_000 if small else 1_000_000
    snapshot_rows = args.snapshot_rows or (200_000 if small else 4_000_000)
    repeats = 50 if small else 200
    results = {"rows": num_rows, "dim": DIM, "batch": BATCH, "cpu_count": os.cpu_count()}
    targets = {}
    if args.part in ("all", "inprocess"):
        results.update(in_process(num_rows, repeats))
        targets.update({"lookup_vs_numpy>=0.5": results["lookup_vs_numpy"] >= 0.5,
                        "nearest_vs_faiss>=0.8": results["nearest_vs_faiss"] >= 0.8,
                        "memory_ratio<=1.5": results["memory_ratio"] <= 1.5})
    if args.part in ("all", "distributed"):
        results.update(distributed_mode(num_rows, calls=50 if small else 150))
        targets.update({
            "dist_lookup_rows_per_s>=1e6": results["dist_lookup_rows_per_s"] >= 1e6,
            "dist_lookup_pipelined_rows_per_s>=1e6":
                results["dist_lookup_pipelined_rows_per_s"] >= 1e6,
            "dist_apply_gradients_rows_per_s>=5e5":
                results["dist_apply_gradients_rows_per_s"] >= 5e5})
    if args.part == "wal":
        results.update(distributed_mode(num_rows, calls=50 if small else 150, only=WAL_VARIANTS))
    if args.part in ("all", "snapshot"):
        import tempfile

        with tempfile.TemporaryDirectory(dir=args.snapshot_dir) as directory:
            results.update(snapshot_in_process(snapshot_rows, 3, directory))
            results.update(snapshot_distributed(snapshot_rows, directory))
        targets.update({
            "snapshot_save_vs_npsave>=0.5": results["snapshot_save_vs_npsave"] >= 0.5,
            "snapshot_load_vs_npload>=0.5": results["snapshot_load_vs_npload"] >= 0.5,
            "dist_snapshot_client_growth_ratio<=0.1":
                results["dist_snapshot_client_growth_ratio"] <= 0.1})
    results["targets_met"] = targets
    results["load_average_1min"] = os.getloadavg()[0]
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in results.items()}))


if __name__ == "__main__":
    main()
