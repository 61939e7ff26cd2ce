"""Summaries (Metz et al. 2022, Appendix H.1): batched, sampled logging to aggregators sharded by
summary name, a checksummed append-only file format, and an incremental reader.

The file format is specified in :mod:`carlskit.summaries._format` and docs/summaries_format.md.
"""

from carlskit.summaries._format import CorruptRecordError
from carlskit.summaries._reader import SummaryReader
from carlskit.summaries._writer import SummaryAggregator, SummaryWriter, shard_of

__all__ = ["SummaryWriter", "SummaryReader", "SummaryAggregator", "CorruptRecordError", "shard_of"]
