"""Export a summary log directory as TensorBoard event files (``SummaryReader.to_tensorboard``).

Event files are written with tensorboardX (the ``tensorboard`` extra: ``pip install
'carlskit[tensorboard]'``): it is maintained, already what our benchmark compares against, and
carries TensorBoard's protobuf schema and the TFRecord framing (length, masked CRC-32C, payload,
masked CRC-32C), which we would otherwise re-implement and keep in step by hand. The core install
does not need it; only exporting does.

What each kind becomes (one ``Event`` per entry, ``step`` and ``wall_time`` kept exactly):

- scalars: ``simple_value`` (TensorBoard stores a float32, so values are rounded to float32);
- histograms: a ``HistogramProto`` with ``bucket_limit`` = the right edges of our bins, ``bucket`` =
  their counts, ``min``/``max`` = the outer edges, ``num`` = the count, and ``sum``/``sum_squares``
  estimated from the bin centres (our format keeps counts, not the values);
- samples: a histogram of the stored subsample (30 equal-width bins over its finite values);
- texts: a string tensor with the ``text`` plugin's metadata (TensorBoard's Text tab).

Events are written in order of step across every summary: TensorBoard's reader treats a step that
goes back as the restart of a crashed run and drops the events after it (``purge_orphaned_data``).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

HISTOGRAM_BINS_FOR_SAMPLES = 30


def _tensorboardx() -> Any:
    try:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    except ImportError as error:
        raise ImportError("exporting summaries to TensorBoard needs tensorboardX: "
                          "pip install 'carlskit[tensorboard]'") from error
    return EventsWriter, event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2


def _histogram(summary_pb2, edges: np.ndarray, counts: np.ndarray):
    centres = (edges[:-1] + edges[1:]) / 2.0
    return summary_pb2.HistogramProto(
        min=float(edges[0]), max=float(edges[-1]), num=float(counts.sum()),
        sum=float(np.dot(counts, centres)), sum_squares=float(np.dot(counts, centres * centres)),
        bucket_limit=edges[1:].tolist(), bucket=counts.tolist())


def export(reader: Any, logdir: str | os.PathLike) -> dict[str, Any]:
    """Write every summary ``reader`` sees into one new event file in ``logdir``; return counts of
    what was written and the file's path."""
    EventsWriter, event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2 = _tensorboardx()
    steps, wall_times, makers, counts = _value_makers(reader, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2)
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    # one synchronous writer (tensorboardX's EventFileWriter pickles every event through a
    # multiprocessing queue); the suffix keeps two exports in the same second apart
    suffix = f".{uuid.uuid4().hex[:8]}.carlskit"
    writer = EventsWriter(str(logdir / "events"), suffix)
    try:
        if makers:
            all_steps = np.concatenate(steps)
            all_walls = np.concatenate(wall_times)
            source = np.repeat(np.arange(len(makers)), [count for _, count in makers])
            index = np.concatenate([np.arange(count) for _, count in makers])
            for position in np.lexsort((all_walls, all_steps)).tolist():
                make = makers[source[position]][0]
                writer.write_event(event_pb2.Event(
                    wall_time=float(all_walls[position]), step=int(all_steps[position]),
                    summary=summary_pb2.Summary(value=[make(int(index[position]))])))
    finally:
        writer.close()
    (path,) = logdir.glob(f"events.out.tfevents.*{suffix}")
    return {**counts, "path": str(path)}


def _value_makers(reader: Any, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2) -> tuple[list, list, list, dict]:
    """Per summary name: its steps, wall times and ``(make(i) -> Summary.Value, count)``, for
    ``export`` to write sorted by step; and the counts of each kind."""
    steps, wall_times, makers = [], [], []
    counts = {"scalars": 0, "histograms": 0, "samples": 0, "texts": 0}

    for name in reader.names("scalars"):
        frame = reader.scalars(name)
        counts["scalars"] += len(frame)
        steps.append(frame["step"].to_numpy())
        wall_times.append(frame["wall_time"].to_numpy())
        values = frame["value"].to_numpy()
        makers.append((lambda i, name=name, values=values: summary_pb2.Summary.Value(
            tag=name, simple_value=float(values[i])), len(frame)))
    for name in reader.names("histograms"):
        frame = reader.histograms(name)
        counts["histograms"] += len(frame)
        steps.append(frame["step"].to_numpy(np.int64))
        wall_times.append(frame["wall_time"].to_numpy(np.float64))
        edges, bins = list(frame["edges"]), list(frame["counts"])
        makers.append((lambda i, name=name, edges=edges, bins=bins: summary_pb2.Summary.Value(
            tag=name, histo=_histogram(summary_pb2, edges[i], bins[i])), len(frame)))
    for name in reader.names("samples"):
        frame = reader.samples(name)
        counts["samples"] += len(frame)
        steps.append(frame["step"].to_numpy(np.int64))
        wall_times.append(frame["wall_time"].to_numpy(np.float64))
        samples = list(frame["values"])

        def sample_histogram(i, name=name, samples=samples):
            finite = samples[i][np.isfinite(samples[i])]
            bins, edges = np.histogram(finite, bins=HISTOGRAM_BINS_FOR_SAMPLES) if finite.size else (
                np.zeros(HISTOGRAM_BINS_FOR_SAMPLES), np.linspace(0.0, 1.0, HISTOGRAM_BINS_FOR_SAMPLES + 1))
            return summary_pb2.Summary.Value(tag=name, histo=_histogram(summary_pb2, edges, bins.astype(float)))

        makers.append((sample_histogram, len(frame)))
    text_metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    for name in reader.names("texts"):
        frame = reader.texts(name)
        counts["texts"] += len(frame)
        steps.append(frame["step"].to_numpy(np.int64))
        wall_times.append(frame["wall_time"].to_numpy(np.float64))
        texts = list(frame["text"])
        makers.append((lambda i, name=name, texts=texts: summary_pb2.Summary.Value(
            tag=name, metadata=text_metadata, tensor=tensor_pb2.TensorProto(
                dtype=types_pb2.DT_STRING, string_val=[texts[i].encode("utf-8")],
                tensor_shape=tensor_shape_pb2.TensorShapeProto())), len(frame)))
    return steps, wall_times, makers, counts
