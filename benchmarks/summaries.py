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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleave, medians, ratio  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="quick run (also CARLSKIT_SMALL=1)")
    args = parser.parse_args()
    small = args.small or os.environ.get("CARLSKIT_SMALL") == "1"
    ours_count = 200_000 if small else 1_000_000
    tensorboard_count = 20_000 if small else 100_000
    read_points = 200_000 if small else 1_000_000
    # vs_tensorboardx: both writers interleaved (benchmarks/_timing.py), ``repeats`` runs each of
    # these many calls, the ratio of rates formed within each repeat.
    repeats = 3 if small else 5
    ours_per_repeat, tensorboard_per_repeat = ours_count // 5, tensorboard_count // 5

    results: dict[str, float | int | str] = {"small": small, "repeats": repeats}
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
            runs = iter(range(10 * repeats))

            def ours() -> float:  # seconds per scalar() call, a fresh writer (its actors) each repeat
                with SummaryWriter(root / f"ours-{next(runs)}", client=client, flush_every_seconds=0.5) as writer:
                    return log_per_call(writer, ours_per_repeat) / ours_per_repeat

            def tensorboard() -> float:
                return log_tensorboardx(str(root / f"tensorboardx-{next(runs)}"),
                                        tensorboard_per_repeat) / tensorboard_per_repeat

            print(f"carlskit vs tensorboardX, interleaved: {repeats} x ({ours_per_repeat} scalar(), "
                  f"{tensorboard_per_repeat} add_scalar()) ...", flush=True)
            samples = interleave({"carlskit": ours, "tensorboardx": tensorboard}, repeats, warmup=False)
            per_call = medians(samples)
            results["scalars_per_s_interleaved"] = round(1 / per_call["carlskit"])
            results["tensorboardx_scalars_per_s"] = round(1 / per_call["tensorboardx"])
            results.update({name: round(value, 3) for name, value
                            in ratio(samples, "tensorboardx", "carlskit", "vs_tensorboardx").items()})
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
        reads = interleave({"read": lambda: SummaryReader(read_dir).scalars("loss"),
                            "fromfile": lambda: np.fromfile(path, dtype=np.uint8),
                            "subsampled": lambda: SummaryReader(read_dir).scalars("loss", max_points=5_000)},
                           repeats=9)
        read_times = medians(reads)
        results.update({
            "read_points": read_points,
            "read_file_mb": round(path.stat().st_size / 2**20, 2),
            "read_s": round(read_times["read"], 4),
            "fromfile_s": round(read_times["fromfile"], 4),
            **{name: round(value, 3) for name, value in ratio(reads, "fromfile", "read", "read_vs_fromfile").items()},
            "read_subsampled_5k_s": round(read_times["subsampled"], 4),
        })
    print(json.dumps(results))


if __name__ == "__main__":
    main()
