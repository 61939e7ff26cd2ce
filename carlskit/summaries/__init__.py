"""Summaries (Metz et al. 2020, Appendix H.1): batched, sampled logging to aggregators sharded by
summary name, a checksummed append-only file format, and an incremental reader.

The file format is specified in :mod:`carlskit.summaries._format` and docs/summaries_format.md.
Delivery (``_delivery``, on :mod:`carlskit.cluster`'s service kit: an ``ActorHost`` and a
``ServiceState`` per aggregator): batches are held until their aggregator acknowledges them and
re-sent to an aggregator rebuilt on a live worker after a lost one; readers drop repeats
(at-least-once on disk, exactly-once as read).
TensorBoard export: ``SummaryReader.to_tensorboard`` and ``python -m carlskit.summaries export``.
"""

from carlskit.summaries._format import CorruptRecordError
from carlskit.summaries._reader import SummaryReader
from carlskit.summaries._writer import SummaryAggregator, SummaryAggregatorError, SummaryWriter, aggregator_of

__all__ = ["SummaryWriter", "SummaryReader", "SummaryAggregator", "SummaryAggregatorError",
           "CorruptRecordError", "aggregator_of"]
