"""The knowledge bank (CARLS section 3.2): sharded embeddings and feature records shared by trainers
and makers, with lazy averaged gradient updates and nearest-neighbour search.

Lazy update rule (per key, per embedding table; thresholds set in ``create_table``):
gradients sent with ``apply_gradients`` are cached until the key is looked up, until it has
``max_pending`` cached gradients, or until its oldest cached gradient is older than
``pending_ttl_seconds`` (checked at the start of every call reaching the key's shard, and by
``flush``). Then, all cached gradients of the key together:

1. gradients containing NaN or Inf are dropped (``stats()["tables"][t]["dropped_nonfinite"]``);
2. if at least 3 remain, g_i is dropped when
   ``||g_i|| > median(n) + outlier_threshold * 1.4826 * median(|n - median(n)|)``
   over the remaining norms n (``dropped_outliers``; default threshold 3);
3. the rest are averaged, g = mean(g_i) (``combine="sum"``: summed, g = sum(g_i); when to use
   which: :mod:`carlskit.bank._lazy`), and one step is taken: ``sgd`` v -= lr * g, ``adagrad``
   a += g**2, v -= lr * g / sqrt(a + eps) (a starts at ``initial_accumulator_value``).

Gradients from every sender (processes, Dask tasks) are cached and counted; ``update`` of a key
discards its cached gradients. See :func:`combine_gradients` for the pure, vectorized rule.

Layout: :class:`KnowledgeBank` (``_bank``) is a facade that validates every call, then delegates:

- ``_config``: the table options, frozen typed dataclasses (``EmbeddingTableConfig``,
  ``FeatureTableConfig``), each option defined once with its check, with ``to_json``/``from_json``;
- ``_transport``: the shard set (``ShardSet``): where the shards live (in-process objects or Dask
  actors), routing keys to shards, submitting one call per shard and collecting the answers (direct
  ZeroMQ path of ``_direct`` or Dask's actor RPC), lost shards recognised by type
  (:func:`carlskit.cluster.is_worker_loss`, :func:`carlskit.cluster.actor_lost`) as
  :class:`ShardLostError`, and a lost shard started again on the least-loaded live worker
  (:meth:`carlskit.cluster.Placement.choose`);
- ``_snapshot``: the snapshot format, save, load, manifest validation, where a lost shard is
  rebuilt from (its write-ahead log in ``_wal``) and the bank's automatic snapshots
  (``BankSnapshots``);
- ``_shard`` / ``_tables``: one shard and its tables (numpy columns, ``_hashmap``, ``_lazy``
  gradients, ``_nearest`` search).
"""

from carlskit.bank._bank import KnowledgeBank
from carlskit.bank._config import EmbeddingTableConfig, FeatureTableConfig, TableConfig
from carlskit.bank._hashing import key_from_string
from carlskit.bank._lazy import CombinedGradients, adagrad_step, combine_gradients, sgd_step
from carlskit.bank._transport import BankFuture, ShardLostError

__all__ = ["KnowledgeBank", "EmbeddingTableConfig", "FeatureTableConfig", "TableConfig", "BankFuture",
           "ShardLostError", "key_from_string", "combine_gradients",
           "CombinedGradients", "sgd_step", "adagrad_step"]
