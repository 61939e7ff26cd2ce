"""Summaries benchmark: scalars/s end to end (writer -> sharded aggregator actors -> disk) against
tensorboardX's ``SummaryWriter.add_scalar`` in the same run, and reading 1M points of one summary
against ``numpy.fromfile`` of the same bytes.

Run from the repository root: ``python benchmarks/summaries.py [--small]`` (or CARLSKIT_SMALL=1).
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import carlskit  # noqa: E402
from carlskit.summaries import SummaryReader, SummaryWriter  # noqa: E402

NAMES = [f"train/metric_{index}" for index in range(16)]


def log_per_call(writer, count: int) -> float:
    """``count`` calls of ``writer.scalar``-like logging over 16 names; returns seconds incl. flush."""
    start = time.perf_counter()
    names = NAMES
    for step in range(count):
        writer.scalar(names[step & 15], step * 1e-3, step)
    writer.flush()
    return time.perf_counter() - start


def log_tensorboardx(logdir: str, count: int) -> float:
    from tensorboardX import SummaryWriter as TensorboardWriter

    writer = TensorboardWriter(logdir)
    start = time.perf_counter()
    names = NAMES
    for step in range(count):
        writer.add_scalar(names[step & 15], step * 1e-3, step)
    writer.flush()
    elapsed = time.perf_counter() - start
    writer.close()
    return elapsed


def best_of(repeats: int, function) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="quick run (also CARLSKIT_SMALL=1)")
    args = parser.parse_args()
    small = args.small or os.environ.get("CARLSKIT_SMALL") == "1"
    ours_count = 200_000 if small else 1_000_000
    tensorboard_count = 20_000 if small else 100_000
    read_points = 200_000 if small else 1_000_000

    results: dict[str, float | int | str] = {"small": small}
    with tempfile.TemporaryDirectory(prefix="carlskit-bench-summaries-") as root:
        root = Path(root)
        client = carlskit.connect(n_workers=2)
        try:
            with SummaryWriter(root / "warmup", client=client) as writer:  # start actors, warm paths
                log_per_call(writer, 20_000)
            with SummaryWriter(root / "distributed", client=client, flush_every_seconds=0.5) as writer:
                print(f"carlskit: {ours_count} scalar() calls through {writer.n_shards} aggregators ...",
                      flush=True)
                seconds = log_per_call(writer, ours_count)
            assert SummaryReader(root / "distributed").count(NAMES[0]) == ours_count // 16
            results["scalars_per_s"] = round(ours_count / seconds)
            with SummaryWriter(root / "batched", client=client) as writer:
                values, steps = np.linspace(0, 1, ours_count), np.arange(ours_count)
                start = time.perf_counter()
                for name in NAMES:
                    writer.scalars(name, values, steps)
                writer.flush()
                results["scalars_per_s_batched_api"] = round(16 * ours_count / (time.perf_counter() - start))
        finally:
            client.close()
        with SummaryWriter(root / "direct", flush_every_seconds=0.5) as writer:
            results["scalars_per_s_direct"] = round(ours_count / log_per_call(writer, ours_count))

        print(f"tensorboardX: {tensorboard_count} add_scalar() calls ...", flush=True)
        tensorboard_seconds = log_tensorboardx(str(root / "tensorboardx"), tensorboard_count)
        results["tensorboardx_scalars_per_s"] = round(tensorboard_count / tensorboard_seconds)
        results["vs_tensorboardx"] = round(results["scalars_per_s"] / results["tensorboardx_scalars_per_s"], 2)

        print(f"reading {read_points} points of one summary ...", flush=True)
        read_dir = root / "read"
        with SummaryWriter(read_dir, flush_every_seconds=60) as writer:
            for start in range(0, read_points, 50_000):  # 50k-point records, as a 1 s flush at 50k/s
                steps = np.arange(start, min(start + 50_000, read_points))
                writer.scalars("loss", np.cos(steps * 1e-4), steps)
                writer.flush()
        (path,) = read_dir.glob("*.level0.summaries")
        frame = SummaryReader(read_dir).scalars("loss")
        assert len(frame) == read_points and frame["step"].iat[-1] == read_points - 1
        read_seconds = best_of(3, lambda: SummaryReader(read_dir).scalars("loss"))
        fromfile_seconds = best_of(3, lambda: np.fromfile(path, dtype=np.uint8))
        subsampled_seconds = best_of(3, lambda: SummaryReader(read_dir).scalars("loss", max_points=5_000))
        results.update({
            "read_points": read_points,
            "read_file_mb": round(path.stat().st_size / 2**20, 2),
            "read_s": round(read_seconds, 4),
            "fromfile_s": round(fromfile_seconds, 4),
            "read_vs_fromfile": round(fromfile_seconds / read_seconds, 3),
            "read_subsampled_5k_s": round(subsampled_seconds, 4),
        })
    print(json.dumps(results))


if __name__ == "__main__":
    main()
